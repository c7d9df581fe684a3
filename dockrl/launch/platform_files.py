"""A site's platform: a preset with the site's images (options or a kustomize overlay) and fields (a file).

``dockrl pipeline compile`` builds the platform it compiles for from ``--platform`` (a preset,
``platform.get_platform``), its fields from ``--platform-config`` (``platform_from_file``), then
its images from ``--overlay`` (``images_from_kustomization``), ``--registry``, ``--tag`` and
``--pull-secret`` (``with_images``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from dockrl.launch.platform import IMAGE_NAMES, IMAGE_REPOSITORY, Platform


def with_images(platform: Platform, *, registry: str = "", tag: str = "", digests: dict[str, str] | None = None,
                pull_secret: str = "") -> Platform:
    """``platform`` with its images from ``registry`` (``registry.example.com/ml``: the images
    are ``<registry>/dockrl-<name>``), ``tag``, ``digests`` and ``pull_secret``; an empty value
    keeps the platform's own.

    Raises:
        ValueError: a value breaks a rule of ``Platform`` (the message names it).
    """
    changes: dict[str, Any] = {}
    if registry:
        changes["image_repository"] = registry.rstrip("/") + "/dockrl"
    if tag:
        changes["image_tag"] = tag
    if digests:
        changes["image_digests"] = {**platform.image_digests, **digests}
    if pull_secret:
        changes["image_pull_secret"] = pull_secret
    return dataclasses.replace(platform, **changes)


def platform_from_file(platform: Platform, path: str | Path) -> Platform:
    """``platform`` with the fields a site's YAML (or JSON) file sets: a mapping of ``Platform``
    fields, e.g. ``devices_per_node: 16``, ``network_interface: net1``, ``extra_resources:
    {rdma/hca_shared_devices_a: "1"}``, ``tolerations: [{key: ..., effect: NoSchedule}]``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a mapping, an unknown field (named, with the known ones), or a value that
            breaks a rule of ``Platform`` (the message names it); each prefixed with the file.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: expected a YAML mapping of platform fields (docs/kubernetes.md)")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{file}: not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a mapping of platform fields, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(Platform)} - {"name"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{file}: unknown platform field(s) {unknown}; expected some of {', '.join(sorted(known))}")
    try:
        return Platform.from_json(json.dumps({**asdict(platform), **data}))
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from None


def images_from_kustomization(path: str | Path) -> dict[str, Any]:
    """The dockrl images an overlay sets (its kustomization's ``images:`` entries named
    ``ghcr.io/dockrl/dockrl-<name>``), as ``with_images`` keywords: ``registry``, ``tag``,
    ``digests``. What the overlay does not set is absent.

    Raises:
        FileNotFoundError: ``path`` is neither a folder with ``kustomization.yaml`` nor a file (names the one missing).
        ValueError: an entry's ``newName`` is not ``<registry>/dockrl-<name>``, its tag is
            ``latest``, or the entries disagree on the registry or the tag.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "kustomization.yaml"
    if not file.is_file():
        raise FileNotFoundError(f"--overlay: {file} does not exist; --overlay takes a kustomize overlay folder (its "
                                "kustomization.yaml, e.g. manifests/overlays/npu) or a file of images: entries (the digests "
                                "file `make images PUSH=1` writes, build/images-digests.yaml)")
    entries = (yaml.safe_load(file.read_text()) or {}).get("images") or []
    registries, tags, digests = set(), set(), {}
    for entry in entries:
        name = str(entry.get("name", ""))
        image = name.removeprefix(IMAGE_REPOSITORY + "-")
        if image == name or image not in IMAGE_NAMES:
            continue  # another image (MinIO, ...)
        new_name = str(entry.get("newName", name))
        if not new_name.endswith(f"/dockrl-{image}"):
            raise ValueError(f"{file}: images entry {name!r} has newName={new_name!r}; expected <registry>/dockrl-{image}")
        registries.add(new_name.removesuffix(f"/dockrl-{image}"))
        if "newTag" in entry:
            tags.add(str(entry["newTag"]))
        if "digest" in entry:
            digests[image] = str(entry["digest"])
    if len(registries) > 1 or len(tags) > 1:
        raise ValueError(f"{file}: the dockrl images differ in registry {sorted(registries)} or tag {sorted(tags)}; "
                         "a run's images come from one registry with one tag (pin single images by digest)")
    if "latest" in tags:
        raise ValueError(f"{file}: newTag 'latest'; pin a release tag")
    out: dict[str, Any] = {}
    if registries:
        out["registry"] = registries.pop()
    if tags:
        out["tag"] = tags.pop()
    if digests:
        out["digests"] = digests
    return out
