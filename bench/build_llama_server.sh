#!/usr/bin/env bash
# Build llama.cpp's llama-server (and llama-bench) from the llama.cpp vendored in the
# llama-cpp-python==0.3.36 source distribution, into DIR (outside the repository; never commit it).
#   bench/build_llama_server.sh /work/peers            (PEER_ISA=avx2 or avxvnni ...: that path, binaries suffixed -avx2 ...)
# leaves DIR/llama-server, DIR/llama-bench, DIR/llama-perplexity and DIR/test-backend-ops (ggml's kernel timings,
# for `python -m bench ggml`). Needs cmake and g++; PIP defaults to
# python3 -m pip.
# Not part of `make test`.
#
# Why these options: a GGML_NATIVE build died with an illegal instruction on the Intel (AMX) machines,
# so the instruction sets are named explicitly, chosen from the flags of the CPU this builds on
# (/proc/cpuinfo): AVX/AVX2/FMA/F16C/BMI2 and each AVX-512 extension only where the CPU has it (an AVX-512
# build dies with SIGILL on an AVX2-only CPU such as AMD Zen 1-3), AMX always off. The binary is therefore
# for this CPU (or one with at least its flags). No curl, no OpenSSL, no prebuilt web UI: the build
# fetches nothing from the network.
set -euo pipefail

out_dir=${1:?usage: $0 OUTPUT_DIR}
version=0.3.36
pip=${PIP:-python3 -m pip}
jobs=${JOBS:-2}

mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)
src_root="$out_dir/src"
mkdir -p "$src_root"

sdist="$src_root/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
    $pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$src_root"
fi
llama_dir="$src_root/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -d "$llama_dir" ]; then
    tar -xzf "$sdist" -C "$src_root"
fi

cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
# PEER_ISA=avx2 builds the AVX2 path on an AVX-512 CPU too (to compare with SLUICE_ISA=avx2 on one machine);
# PEER_ISA=avxvnni the same with AVX-VNNI (an Intel client core's build, beside SLUICE_ISA=avxvnni)
case "${PEER_ISA:-native}" in
    avx2) cpu_flags=$(echo "$cpu_flags" | sed -E 's/ avx512[a-z0-9_]*//g; s/ avx_vnni//g'); cpu_flags=" $cpu_flags " ;;
    avxvnni) cpu_flags=$(echo "$cpu_flags" | sed -E 's/ avx512[a-z0-9_]*//g'); cpu_flags=" $cpu_flags " ;;
esac
has() { case "$cpu_flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
isa_options=(
    -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)"
    -DGGML_BMI2="$(has bmi2)" -DGGML_AVX_VNNI="$(has avx_vnni)"
    -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
    -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
)
echo "instruction sets: ${isa_options[*]}"

build_dir="$src_root/build${PEER_ISA:+-$PEER_ISA}"
cmake -S "$llama_dir" -B "$build_dir" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF \
    "${isa_options[@]}" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$build_dir" --target llama-server llama-bench llama-perplexity test-backend-ops -j "$jobs"

suffix=${PEER_ISA:+-$PEER_ISA}
for tool in llama-server llama-bench llama-perplexity test-backend-ops; do cp "$build_dir/bin/$tool" "$out_dir/$tool$suffix"; done
"$out_dir/llama-server$suffix" --version 2>&1 | tail -n 2
echo "built $out_dir/llama-server$suffix, $out_dir/llama-bench$suffix, $out_dir/llama-perplexity$suffix and $out_dir/test-backend-ops$suffix"
