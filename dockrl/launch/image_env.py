"""The image's environment set-up for processes that KFP starts past the image's ENTRYPOINT.

The NPU image's entry point (``images/npu/entrypoint.sh``) sources CANN's ``set_env.sh`` files
(toolkit, bisheng for triton-ascend, NNAL/ATB for vllm-ascend) before it runs ``dockrl``; worker
pods pass only arguments, so they get it. A KFP task's container has a command of KFP's own
(``python3 -m kfp.dsl.executor_main ...``), which bypasses the ENTRYPOINT: the tasks that use the
devices (train with the local worker backend, evaluate) call ``enter_image_environment`` first,
which runs the same process again through the entry point. ``LD_LIBRARY_PATH`` and the like
only take effect when a process starts, so setting them from Python would be too late.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

ENTRYPOINT_ENV = "DOCKRL_ENTRYPOINT"
"""Set by an image whose entry point sets up its environment: the entry point's path."""
READY_ENV = "DOCKRL_IMAGE_ENV"
"""Set (to ``1``) by that entry point: the environment is set up."""


def enter_image_environment() -> None:
    """Run this process again through the image's entry point (``<entrypoint> --exec python
    <this process's arguments>``) unless its environment is set up already or the image has no
    such entry point (cpu, gpu, a laptop): then return at once. Call it before the task has done
    anything: the process starts over with the same arguments.

    Raises:
        OSError: the entry point named by ``DOCKRL_ENTRYPOINT`` cannot be executed.
    """
    entrypoint = os.environ.get(ENTRYPOINT_ENV, "")
    if not entrypoint or os.environ.get(READY_ENV) == "1":
        return
    logger.info("running this task again through %s, which sets up the image's environment", entrypoint)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(entrypoint, [entrypoint, "--exec", sys.executable, *sys.orig_argv[1:]])
