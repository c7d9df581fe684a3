#!/usr/bin/env bash
# Build the three dockrl images (images/cpu, images/cuda -> dockrl-gpu, images/npu), each for every
# architecture it supports (cpu, npu: linux/amd64 and linux/arm64; gpu: linux/amd64; the same as
# IMAGE_ARCHITECTURES in dockrl/launch/platform.py) and, with PUSH=1, push them and write their digests.
#
#   make images                                          # this machine's architecture, loaded locally
#   REGISTRY=registry.example.com/ml TAG=0.1.0 PUSH=1 make images   # every architecture, pushed
#   OCI=1 make images                                    # every architecture, as OCI archives in build/
#   IMAGES="cpu" make images                             # only some of them
#
# Where the images go (docker buildx):
#   PUSH=1   every platform of each image, pushed as one multi-platform image (a manifest list);
#            its digest goes to DIGESTS_FILE
#   OCI=1    every platform of each image, written to build/dockrl-<name>-<TAG>.oci.tar (an OCI
#            image layout, multi-platform; `docker buildx imagetools`, skopeo or crane read it)
#   neither  only this machine's platform (of those the image supports; else its first), loaded
#            into the local engine: `--load` into the classic docker image store takes one platform
# Building a platform other than the machine's needs QEMU (docker/setup-qemu-action, tonistiigi/binfmt).
#
# Settings (environment):
#   REGISTRY      where the images go: <REGISTRY>/dockrl-{cpu,gpu,npu} (default: ghcr.io/dockrl)
#   TAG           their tag, never "latest" (default: the version in pyproject.toml)
#   IMAGES        which ones, out of "cpu gpu npu" (default: all three)
#   PUSH, OCI     see above (default: 0, 0)
#   DIGESTS_FILE  where the pushed digests go, as the images: of a kustomization (default:
#                 build/images-digests.yaml); `dockrl pipeline compile --overlay <it>` reads them
#   CPU_PLATFORMS, GPU_PLATFORMS, NPU_PLATFORMS   comma-separated platforms of each (defaults above);
#                 more than one needs PUSH=1 or OCI=1
#   DOCKER        the docker CLI (default: docker); it needs buildx
#   COMMIT        the commit the images record (DOCKRL_COMMIT in them, and their OCI revision label)
#                 (default: this checkout's, 12 hex digits, with -dirty where tracked files changed)
set -euo pipefail

cd "$(dirname "$0")/.."
DOCKER=${DOCKER:-docker}
REGISTRY=${REGISTRY:-ghcr.io/dockrl}
TAG=${TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)}
IMAGES=${IMAGES:-"cpu gpu npu"}
PUSH=${PUSH:-0}
OCI=${OCI:-0}
DIGESTS_FILE=${DIGESTS_FILE:-build/images-digests.yaml}
if [[ -z "${COMMIT:-}" ]] && COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null); then
    if [[ -n "$(git status --porcelain --untracked-files=no)" ]]; then COMMIT="$COMMIT-dirty"; fi
fi
COMMIT=${COMMIT:-}

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
# Every platform each image is built for; keep the defaults equal to IMAGE_ARCHITECTURES
# (dockrl/launch/platform.py; tests/launch/test_images.py checks it).
platforms_of() {
    case "$1" in
        cpu) echo "${CPU_PLATFORMS:-linux/amd64,linux/arm64}" ;;
        gpu) echo "${GPU_PLATFORMS:-linux/amd64}" ;;
        npu) echo "${NPU_PLATFORMS:-linux/amd64,linux/arm64}" ;;
    esac
}
# The platform to build when loading into the local engine: this machine's, if the image has it.
host_platform() {
    case "$(uname -m)" in
        x86_64 | amd64) echo linux/amd64 ;;
        aarch64 | arm64) echo linux/arm64 ;;
        *) uname -m ;;
    esac
}
local_platform_of() {
    local platforms host
    platforms=$(platforms_of "$1")
    host=$(host_platform)
    if [[ ",$platforms," == *",$host,"* ]]; then echo "$host"; else echo "${platforms%%,*}"; fi
}

for name in $IMAGES; do
    if ! folder_of "$name" >/dev/null; then
        echo "build_images: IMAGES has '$name'; expected some of: cpu gpu npu" >&2
        exit 2
    fi
done
if [[ "$PUSH" == 1 && "$OCI" == 1 ]]; then
    echo "build_images: PUSH=1 and OCI=1: choose one (push to REGISTRY, or write OCI archives to build/)" >&2
    exit 2
fi
if [[ "$PUSH" != 1 && "$OCI" != 1 ]]; then
    for var in CPU_PLATFORMS GPU_PLATFORMS NPU_PLATFORMS; do
        if [[ "${!var:-}" == *,* ]]; then
            echo "build_images: $var='${!var}' names several platforms, which --load cannot put into the classic" \
                 "docker image store; set PUSH=1 or OCI=1, or one platform" >&2
            exit 2
        fi
    done
fi

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
    if [[ "$PUSH" == 1 ]]; then
        platforms=$(platforms_of "$name")
        output=(--push)
    elif [[ "$OCI" == 1 ]]; then
        platforms=$(platforms_of "$name")
        output=(--output "type=oci,dest=build/dockrl-$name-$TAG.oci.tar")
    else
        platforms=$(local_platform_of "$name")
        output=(--load)
    fi
    echo "build_images: $ref from $folder/Dockerfile ($platforms)"
    "$DOCKER" buildx build --platform "$platforms" -f "$folder/Dockerfile" -t "$ref" \
        --label "org.opencontainers.image.version=$TAG" --label "org.opencontainers.image.revision=$COMMIT" \
        --build-arg "DOCKRL_COMMIT=$COMMIT" --metadata-file "$metadata" "${output[@]}" .
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
