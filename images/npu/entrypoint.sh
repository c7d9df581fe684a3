#!/usr/bin/env bash
# Entry point of dockrl-npu: set up the CANN environment the way the CANN base image's own entry point
# does (quay.io/ascend/cann, Ascend/cann-container-image), then run `dockrl <arguments>`.
#
# Replacing the base image's ENTRYPOINT drops its set-up, so this script sources the same files:
#   ${ASCEND_ROOT}/ascend-toolkit/set_env.sh                              toolkit (required)
#   ${ASCEND_TOOLKIT_HOME}/share/info/ascendnpu-ir/bin/set_env.sh         bisheng, the compiler triton-ascend
#                                                                         JIT-compiles with (CANN >= 8.5; optional)
#   ${ASCEND_ROOT}/nnal/atb/set_env.sh --cxx_abi=${ATB_CXX_ABI:-1}        NNAL/ATB, libatb.so for vllm-ascend (required)
# ASCEND_TOOLKIT_HOME is set by the toolkit's set_env.sh (/usr/local/Ascend/cann-<version>).
#
# Environment: DOCKRL_ASCEND_ROOT, where CANN is installed (default /usr/local/Ascend).
# `--exec PROGRAM ARGS...` runs PROGRAM instead of dockrl, with the same set-up: a KFP task's
# command bypasses the ENTRYPOINT, and its Python process re-runs itself this way (DOCKRL_ENTRYPOINT).
# Exit status: 127 when a required set_env.sh is missing, that of a set_env.sh that fails, else dockrl's.
set -eo pipefail

ASCEND_ROOT=${DOCKRL_ASCEND_ROOT:-/usr/local/Ascend}

# Sourced from a function so that the set_env.sh scripts see only their own arguments, not dockrl's.
source_env() {
    local kind=$1 file=$2
    shift 2
    if [[ ! -f "$file" ]]; then
        if [[ "$kind" == required ]]; then
            echo "dockrl-npu entrypoint: $file is missing: the CANN installation under ASCEND_ROOT=$ASCEND_ROOT" \
                 "(DOCKRL_ASCEND_ROOT) is incomplete; build the image on a quay.io/ascend/cann base (images/npu/Dockerfile)" >&2
            exit 127
        fi
        echo "dockrl-npu entrypoint: $file is missing: skipped (triton-ascend kernels need bisheng, CANN >= 8.5)" >&2
        return 0
    fi
    # set_env.sh scripts read unset variables (LD_LIBRARY_PATH, PYTHONPATH on a bare image) and run
    # commands that may fail on the way: source them without -e, as the base image's `bash -c` does,
    # and judge each by its final status, as its `source ... &&` chain does.
    set +e
    # shellcheck source=/dev/null
    source "$file" "$@"
    local status=$?
    set -e
    if [[ $status -ne 0 ]]; then
        echo "dockrl-npu entrypoint: sourcing $file failed (exit $status)" >&2
        exit "$status"
    fi
}

source_env required "$ASCEND_ROOT/ascend-toolkit/set_env.sh"
source_env optional "${ASCEND_TOOLKIT_HOME:-$ASCEND_ROOT/ascend-toolkit/latest}/share/info/ascendnpu-ir/bin/set_env.sh"
source_env required "$ASCEND_ROOT/nnal/atb/set_env.sh" "--cxx_abi=${ATB_CXX_ABI:-1}"

export DOCKRL_IMAGE_ENV=1  # set up once: what dockrl.launch.image_env checks before re-running a process here
if [[ "${1:-}" == "--exec" ]]; then
    # a process that a KFP task's own command started (it bypasses the ENTRYPOINT): it runs itself
    # again through here (dockrl.launch.image_env.enter_image_environment), now with CANN's environment
    shift
    exec "$@"
fi
exec dockrl "$@"
