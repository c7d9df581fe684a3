"""KFP components of the GRPO pipeline, one file each; each body calls one library function."""
