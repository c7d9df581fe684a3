"""KFP components of the GRPO and rescore pipelines, one file each; each body calls one library function.

Installed as ``dockrl.components`` (pyproject.toml's package-dir; the folder stays at the top of the
repository). A component's imports are in its body: KFP ships only the function's source to the
task's pod, where ``dockrl`` is installed.
"""
