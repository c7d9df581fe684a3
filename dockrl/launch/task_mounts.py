"""A local pipeline run shaped like the cluster: each task sees only the volumes it declares.

On a cluster, a task's pod holds the volumes its compiled spec mounts (``kfp.kubernetes.mount_pvc``) and
nothing else of the run's; ``kfp.local`` runs every task as a process of this machine, which sees every
file. ``isolate_volumes`` rewrites a pipeline before its local run so that each task starts through
``python -m dockrl.launch.task_mounts --hide FOLDER ... -- <its command>``: in a mount namespace of its own
(``unshare(CLONE_NEWNS)``) where an empty, read-only tmpfs covers the folder of every volume the task does
not mount. A task that reads the shared volume without declaring it then fails here as in its pod, with
the same FileNotFoundError. The task's processes, the local worker backend's workers among them,
inherit its namespace: they see what the pod's processes would.

A local volume is a folder of this machine mounted at that same path (the local run's platform has
``shared_mount_path`` = the folder). Creating a mount namespace needs CAP_SYS_ADMIN (root, as CI runs).
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x1, 0x2, 0x4, 0x4000, 0x40000
"""From <linux/sched.h> and <linux/mount.h>: the flags of unshare(2) and mount(2) used here."""


def can_isolate() -> bool:
    """Whether this process may create mount namespaces (root; the tasks inherit its rights)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0 and sys.platform == "linux"


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"task_mounts: {what}: {os.strerror(err)} (a cluster-shaped local run needs CAP_SYS_ADMIN: run as root)")


def hide(folders: Sequence[str | Path]) -> None:
    """Move this process into a mount namespace of its own where each of ``folders`` is an empty, read-only tmpfs.

    Raises:
        OSError: the namespace or a mount is refused (not root), naming which.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # private: the tmpfs mounts below stay in this namespace, never propagate back to the machine's
    _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    for folder in folders:
        path = str(Path(folder).resolve()).encode()
        _check(libc.mount(b"tmpfs", path, b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, b"size=4k,mode=0555"),
               f"mount tmpfs over {folder}")


def isolate_volumes(pipeline: Any, volumes: Mapping[str, str | Path]) -> dict[str, list[str]]:
    """Make each task of ``pipeline`` (a ``kfp`` pipeline, before its local run) start in a mount namespace
    where the folder of every volume in ``volumes`` (PVC name -> local folder) that its compiled
    Kubernetes spec does not mount is hidden (``hide``). Returns executor -> the folders it hides.

    Raises:
        ValueError: a task mounts one of ``volumes`` at another path than its folder (a local run mounts
            nothing elsewhere; compile the local run's platform with ``shared_mount_path`` = the folder).
    """
    from google.protobuf import json_format  # lazy: the wrapper that starts each task stays light

    folders = {claim: str(Path(f).resolve()) for claim, f in volumes.items()}
    platform = json_format.MessageToDict(pipeline.platform_spec)
    k8s = ((platform.get("platforms") or {}).get("kubernetes") or {}).get("deploymentSpec", {}).get("executors", {})
    spec = pipeline.pipeline_spec
    deployment = json_format.MessageToDict(spec.deployment_spec)
    out: dict[str, list[str]] = {}
    for name, executor in deployment["executors"].items():
        declared = set()
        for mount in k8s.get(name, {}).get("pvcMount", []):
            claim = mount.get("constant") or mount.get("pvcNameParameter", {}).get("runtimeValue", {}).get("constant")
            if claim in folders and str(Path(mount["mountPath"]).resolve()) != folders[claim]:
                raise ValueError(f"{name} mounts {claim} at {mount['mountPath']}; a local run has it at {folders[claim]} "
                                 "only: compile the local run with shared_mount_path at that folder")
            declared.add(claim)
        hidden = sorted(f for claim, f in folders.items() if claim not in declared)
        out[name] = hidden
        if hidden:
            container = executor["container"]
            flags = [x for f in hidden for x in ("--hide", f)]
            # "python3": kfp.local's subprocess runner puts its own interpreter there
            container["command"] = ["python3", "-m", "dockrl.launch.task_mounts", *flags, "--", *container["command"]]
    spec.deployment_spec.Clear()
    spec.deployment_spec.update(deployment)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dockrl.launch.task_mounts --hide FOLDER [--hide FOLDER ...] -- COMMAND...``: ``hide``, then exec COMMAND."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        raise SystemExit("usage: python -m dockrl.launch.task_mounts --hide FOLDER ... -- COMMAND ...")
    cut = args.index("--")
    flags, command = args[:cut], args[cut + 1:]
    if len(flags) % 2 or any(f != "--hide" for f in flags[::2]) or not command:
        raise SystemExit(f"task_mounts: expected --hide FOLDER pairs, then -- and a command; got {args}")
    hide(flags[1::2])
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
