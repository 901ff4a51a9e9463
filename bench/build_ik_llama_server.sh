#!/usr/bin/env bash
# Build ik_llama.cpp's llama-server from the ik_llama.cpp vendored in the ik-llama-cpp-python==0.1.5 source
# distribution, into DIR (outside the repository; never commit it).
#   bench/build_ik_llama_server.sh /work/peers        (PEER_ISA=avx2 ...: the AVX2 path, suffixed -avx2)
# leaves DIR/ik-llama-server and DIR/ik-llama-server-peer, which runs it as `bench load --llama-server` starts
# llama-server: without `--no-webui` (ik's server does not know it) and with `-fa off`. Needs cmake, ninja and g++; PIP defaults to python3 -m pip. Not part of `make test`.
#
# The sdist lacks common/cmake/build-info-gen-cpp.cmake (its build-info step fails without it): a small one is
# written here. Instruction sets as in build_llama_server.sh: from this CPU's flags, AVX-512 only where present.
# On an AVX2-only CPU run it with `-fa off`: its flash attention asserted on the bench workload there.
set -euo pipefail

out_dir=${1:?usage: $0 OUTPUT_DIR}
version=0.1.5
pip=${PIP:-python3 -m pip}
jobs=${JOBS:-2}

mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)
src_root="$out_dir/ik-src"
mkdir -p "$src_root"

sdist="$src_root/ik_llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
    $pip download --no-deps --no-binary ik-llama-cpp-python "ik-llama-cpp-python==$version" -d "$src_root"
fi
ik_dir="$src_root/ik_llama_cpp_python-$version/vendor/ik_llama.cpp"
if [ ! -d "$ik_dir" ]; then
    tar -xzf "$sdist" -C "$src_root"
fi
gen="$ik_dir/common/cmake/build-info-gen-cpp.cmake"
if [ ! -f "$gen" ]; then
    mkdir -p "$(dirname "$gen")"
    cat > "$gen" <<'CMAKE'
# written by sluice's bench/build_ik_llama_server.sh: the sdist ships without it
set(BUILD_NUMBER 0)
set(BUILD_COMMIT "ik-llama-cpp-python-sdist")
set(BUILD_COMPILER "${CMAKE_C_COMPILER_ID} ${CMAKE_C_COMPILER_VERSION}")
set(BUILD_TARGET "x86_64")
configure_file("${CMAKE_CURRENT_LIST_DIR}/../build-info.cpp.in" "${CMAKE_CURRENT_LIST_DIR}/../build-info.cpp")
CMAKE
fi

cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
# PEER_ISA=avx2 builds the AVX2 path on an AVX-512 CPU too (to compare with SLUICE_ISA=avx2 on one machine)
if [ "${PEER_ISA:-native}" = avx2 ]; then cpu_flags=$(echo "$cpu_flags" | sed -E 's/ avx512[a-z0-9_]*//g'); cpu_flags=" $cpu_flags "; fi
has() { case "$cpu_flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
isa_options=(
    -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)"
    -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
    -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
)
echo "instruction sets: ${isa_options[*]}"

build_dir="$src_root/build${PEER_ISA:+-$PEER_ISA}"
cmake -S "$ik_dir" -B "$build_dir" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF \
    "${isa_options[@]}" \
    -DGGML_CCACHE=OFF -DGGML_NCCL=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON
cmake --build "$build_dir" --target llama-server -j "$jobs"

suffix=${PEER_ISA:+-$PEER_ISA}
cp "$build_dir/bin/llama-server" "$out_dir/ik-llama-server$suffix"
cat > "$out_dir/ik-llama-server-peer$suffix" <<WRAPPER
#!/usr/bin/env bash
# written by sluice's bench/build_ik_llama_server.sh: llama-server's arguments for ik's server
args=()
for arg in "\$@"; do [ "\$arg" = --no-webui ] || args+=("\$arg"); done
exec "$out_dir/ik-llama-server$suffix" "\${args[@]}" -fa off
WRAPPER
chmod +x "$out_dir/ik-llama-server-peer$suffix"
"$out_dir/ik-llama-server$suffix" --version 2>&1 | tail -n 2 || true
echo "built $out_dir/ik-llama-server$suffix and $out_dir/ik-llama-server-peer$suffix"
