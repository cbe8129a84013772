#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the CPU peer of benchmarks/offline_throughput.py --peer llamacpp)
# from the llama-cpp-python source package on PyPI, which vendors llama.cpp. The sdist, the unpacked
# and patched source, the build tree, and `bin/llama-server` + `bin/BUILD_INFO` land in $LLAMACPP_DIR
# (git-ignored); the build tools (a venv with cmake, ninja and scikit-build-core from PyPI) in
# $LLAMACPP_TOOLS, outside the project tree (default ~/.cache/pagedserve/llamacpp-tools). No
# llama.cpp code is ever committed here. Re-running reuses what is there (delete the folders for a
# clean build).
#
#   make peer-llamacpp                                # llama-cpp-python 0.3.36 (llama.cpp 0c1e57098)
#   LLAMA_CPP_PYTHON_VERSION=0.3.37 make peer-llamacpp  # another release (the AMX patch must still apply)
set -euo pipefail

PYTHON=${PYTHON:-python3}
DIR=$(mkdir -p "${LLAMACPP_DIR:-build/llamacpp}" && cd "${LLAMACPP_DIR:-build/llamacpp}" && pwd)
# Pinned: the release this benchmark's figures and the AMX patch below were made with.
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${LLAMACPP_JOBS:-2}

TOOLS=$(mkdir -p "${LLAMACPP_TOOLS:-$HOME/.cache/pagedserve/llamacpp-tools}" \
    && cd "${LLAMACPP_TOOLS:-$HOME/.cache/pagedserve/llamacpp-tools}" && pwd)
echo "== tools (cmake, ninja from PyPI) in $TOOLS"
if [ ! -x "$TOOLS/bin/ninja" ]; then
    "$PYTHON" -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q cmake ninja scikit-build-core
fi
export PATH="$TOOLS/bin:$PATH"

echo "== source: llama-cpp-python ${VERSION:-(newest)} sdist"
mkdir -p "$DIR/sdist"
if ! ls "$DIR"/sdist/llama_cpp_python-${VERSION:-*}.tar.gz >/dev/null 2>&1; then
    # --no-build-isolation: pip reads the sdist's metadata with the tools venv's scikit-build-core
    # instead of installing a second copy of the build backend.
    "$TOOLS/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation \
        -d "$DIR/sdist" "llama-cpp-python${VERSION:+==$VERSION}"
fi
SDIST=$(ls -t "$DIR"/sdist/llama_cpp_python-${VERSION:-*}.tar.gz | head -1)
NAME=$(basename "$SDIST" .tar.gz)  # llama_cpp_python-X.Y.Z
SRC="$DIR/src/$NAME/vendor/llama.cpp"
if [ ! -d "$SRC" ]; then
    mkdir -p "$DIR/src"
    # Only what the build reads: the packages' documentation and GitHub templates stay in the sdist.
    tar xzf "$SDIST" -C "$DIR/src" --exclude="$NAME/docs" --exclude="$NAME/.github" \
        --exclude="$NAME/vendor/llama.cpp/docs" --exclude="$NAME/vendor/llama.cpp/.github"
fi

# The sdist has no .git; the llama.cpp commit it vendors is the one its CHANGELOG names for this
# release ("update llama.cpp to ggml-org/llama.cpp@<sha>").
PKG_VERSION=${NAME#llama_cpp_python-}
COMMIT=$(awk -v v="## [$PKG_VERSION]" '$0 == v {on = 1; next} /^## \[/ {on = 0}
    on && match($0, /llama\.cpp@[0-9a-f]+/) {print substr($0, RSTART + 10, RLENGTH - 10); exit}' \
    "$DIR/src/$NAME/CHANGELOG.md")
COMMIT=${COMMIT:-unknown}

echo "== patch: compiler barrier after the AMX tile config (GCC 12 drops its stores otherwise)"
# With GCC 12 and -march=native the stores that fill `tc` are dropped as dead before
# `_tile_loadconfig(&tc)` (it takes the address through an intrinsic GCC does not see reading it),
# so the first AMX matmul dies with SIGILL. A memory clobber keeps the stores.
AMX="$SRC/ggml/src/ggml-cpu/amx/mmq.cpp"
if [ -f "$AMX" ] && ! grep -q 'pagedserve: compiler barrier' "$AMX"; then
    grep -q '^    _tile_loadconfig(&tc);$' "$AMX" || {
        echo "AMX patch: anchor line not found in $AMX; check whether this llama.cpp still needs it" >&2
        exit 1
    }
    sed -i 's|^    _tile_loadconfig(&tc);$|    asm volatile("" ::: "memory");  // pagedserve: compiler barrier (GCC 12)\n    _tile_loadconfig(\&tc);|' "$AMX"
fi

echo "== configure + build llama-server (GGML_NATIVE=ON, $JOBS jobs; a few minutes)"
# GIT_CEILING_DIRECTORIES: llama.cpp's build-info asks git for its commit; without a ceiling git would
# walk up into *our* repository and report our commit as llama.cpp's.
export GIT_CEILING_DIRECTORIES="$DIR"
# CMAKE_MAKE_PROGRAM: the tools' ninja, also for a build tree configured with tools elsewhere.
cmake -S "$SRC" -B "$DIR/build" -G Ninja -DCMAKE_MAKE_PROGRAM="$TOOLS/bin/ninja" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT="$COMMIT" >"$DIR/configure.log"
cmake --build "$DIR/build" --target llama-server -j "$JOBS"

mkdir -p "$DIR/bin"
cp "$DIR/build/bin/llama-server" "$DIR/bin/llama-server"
{
    echo "llama_cpp_python=$PKG_VERSION"
    echo "llama_cpp_commit=$COMMIT"
    echo "compiler=$(${CXX:-c++} --version | head -1)"
    echo "flags=GGML_NATIVE=ON, AMX tile-config barrier patch"
} >"$DIR/bin/BUILD_INFO"
echo "== done: $DIR/bin/llama-server"
cat "$DIR/bin/BUILD_INFO"
