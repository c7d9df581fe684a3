#!/usr/bin/env bash
# Build the three dockrl images (images/cpu, images/cuda -> dockrl-gpu, images/npu) and, with
# PUSH=1, push them and write their digests.
#
#   make images                                          # build for the default registry and tag
#   REGISTRY=registry.example.com/ml TAG=0.1.0 PUSH=1 make images
#   IMAGES="cpu" make images                             # only some of them
#
# Settings (environment):
#   REGISTRY      where the images go: <REGISTRY>/dockrl-{cpu,gpu,npu} (default: ghcr.io/dockrl)
#   TAG           their tag, never "latest" (default: the version in pyproject.toml)
#   IMAGES        which ones, out of "cpu gpu npu" (default: all three)
#   PUSH          1: push, then write DIGESTS_FILE (default: 0, load into the local engine)
#   DIGESTS_FILE  where the pushed digests go, as the images: of a kustomization (default:
#                 build/images-digests.yaml); `dockrl pipeline compile --overlay <it>` reads them
#   CPU_PLATFORM, GPU_PLATFORM, NPU_PLATFORM   target platform of each (default: linux/amd64,
#                 linux/amd64, linux/arm64: Ascend servers are mostly Kunpeng, aarch64)
#   DOCKER        the docker CLI (default: docker); it needs buildx
set -euo pipefail

cd "$(dirname "$0")/.."
DOCKER=${DOCKER:-docker}
REGISTRY=${REGISTRY:-ghcr.io/dockrl}
TAG=${TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)}
IMAGES=${IMAGES:-"cpu gpu npu"}
PUSH=${PUSH:-0}
DIGESTS_FILE=${DIGESTS_FILE:-build/images-digests.yaml}

REGISTRY=${REGISTRY%/}
if [[ -z "$TAG" || "$TAG" == "latest" ]]; then
    echo "build_images: TAG='$TAG': pin a release tag (e.g. the version in pyproject.toml), never 'latest'" >&2
    exit 2
fi
if [[ ! "$REGISTRY" =~ ^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$ ]]; then
    echo "build_images: REGISTRY='$REGISTRY': expected a registry path in lower case without scheme or tag," \
         "e.g. registry.example.com/ml" >&2
    exit 2
fi

folder_of() { case "$1" in cpu) echo images/cpu ;; gpu) echo images/cuda ;; npu) echo images/npu ;; *) return 1 ;; esac; }
platform_of() {
    case "$1" in
        cpu) echo "${CPU_PLATFORM:-linux/amd64}" ;;
        gpu) echo "${GPU_PLATFORM:-linux/amd64}" ;;
        npu) echo "${NPU_PLATFORM:-linux/arm64}" ;;
    esac
}

for name in $IMAGES; do
    if ! folder_of "$name" >/dev/null; then
        echo "build_images: IMAGES has '$name'; expected some of: cpu gpu npu" >&2
        exit 2
    fi
done

mkdir -p build
if [[ "$PUSH" == 1 ]]; then
    printf '# images pushed by scripts/build_images.sh (tag %s), by digest: copy the entries into an\n# overlay, or compile with `dockrl pipeline compile --overlay %s`\nimages:\n' \
        "$TAG" "$DIGESTS_FILE" > "$DIGESTS_FILE"
fi
for name in $IMAGES; do
    folder=$(folder_of "$name")
    ref="$REGISTRY/dockrl-$name:$TAG"
    metadata="build/metadata-$name.json"
    rm -f "$metadata"
    output=(--load)
    [[ "$PUSH" == 1 ]] && output=(--push)
    echo "build_images: $ref from $folder/Dockerfile ($(platform_of "$name"))"
    "$DOCKER" buildx build --platform "$(platform_of "$name")" -f "$folder/Dockerfile" -t "$ref" \
        --label "org.opencontainers.image.version=$TAG" --metadata-file "$metadata" "${output[@]}" .
    if [[ "$PUSH" == 1 ]]; then
        digest=$(sed -n 's/.*"containerimage.digest": *"\(sha256:[0-9a-f]\{64\}\)".*/\1/p' "$metadata" | head -n 1)
        if [[ -z "$digest" ]]; then
            echo "build_images: no containerimage.digest in $metadata after pushing $ref" >&2
            exit 1
        fi
        printf -- '  - name: ghcr.io/dockrl/dockrl-%s\n    newName: %s/dockrl-%s\n    newTag: %s\n    digest: %s\n' \
            "$name" "$REGISTRY" "$name" "$TAG" "$digest" >> "$DIGESTS_FILE"
        echo "build_images: pushed $REGISTRY/dockrl-$name@$digest"
    fi
done
[[ "$PUSH" == 1 ]] && echo "build_images: digests in $DIGESTS_FILE"
exit 0
