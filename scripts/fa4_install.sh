#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4 + CuTe DSL, cu13) for a GPU machine without network, carried in .whl/.
#
#   here (network):  bash scripts/fa4_install.sh pack [NUM_PARTS]   download + pack into .whl/
#   there (GPU):     bash scripts/fa4_install.sh path                 the PYTHONPATH entries of the installed set
#   there (GPU):     bash scripts/fa4_install.sh [command ...]       install into $FA4_SITE (/tmp/site),
#                    smoke-test FA4 (FA4_SMOKE=0 skips), then run `command` with PYTHONPATH set
# Why each step is the way it is: docs/flash_attn4.md.
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=.whl
SITE=${FA4_SITE:-/tmp/site}
PARTS=/tmp/fa4_parts  # survives between two calls while the machine stays warm
FA4=4.0.0b36
DSL=4.8.1
# The GPU image already has torch 2.11, triton, einops, typing-extensions, protobuf and cuda-bindings.
WHEELS="flash-attn-4==$FA4 nvidia-cutlass-dsl==$DSL nvidia-cutlass-dsl-libs-base==$DSL
        nvidia-cutlass-dsl-libs-core==$DSL nvidia-cutlass-dsl-libs-cu13==$DSL apache-tvm-ffi==0.1.15.post2
        torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5"
PLATFORM="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64"

store_members() {  # rewrite each wheel in $1 with its members STORED, into $1/stored
  python3 - "$1" <<'PY'
import pathlib, sys, zipfile
dl = pathlib.Path(sys.argv[1])
for whl in sorted(dl.glob("*.whl")):
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(dl / "stored" / whl.name, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():  # same names, bytes, modes and RECORD: only the compression changes
            data = src.read(info)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
PY
}

pack() {  # here: download the cp312 wheels and pack them into .whl/fa4.tar.xz.partNN
  local parts=${1:-1} dl=/tmp/fa4_download
  # only the old parts go: the other carried wheels (scripts/serve_wheels.sh) live in .whl/ too. A call carries
  # 64 MiB at most, and the parts are 57 MB: carry them with attn_gym alone, the rest in calls without FA4.
  rm -rf "$dl" "$WHL"/fa4.* && mkdir -p "$WHL" "$dl/stored"
  for spec in $WHEELS; do python3 -m pip download -q --no-deps $PLATFORM -d "$dl" "$spec"; done
  # A wheel is a deflated zip, which xz cannot shrink further (libs-cu13 is 92 MB so). Stored members
  # let one xz stream with the x86 BCJ filter compress the raw contents, mostly machine code.
  store_members "$dl"
  tar -C "$dl/stored" -cf - . | xz -T1 --x86 --lzma2=preset=9e,dict=256MiB > "$dl/fa4.tar.xz"
  (cd "$dl" && sha256sum fa4.tar.xz) > "$WHL/fa4.sha256"
  split -n "$parts" -d -a 2 "$dl/fa4.tar.xz" "$WHL/fa4.tar.xz.part"
  echo "$parts" > "$WHL/fa4.parts"
  ls -l "$WHL"
  du -cb "$WHL"/* | tail -1
}

gather() {  # there: collect this call's part(s) in $PARTS; exit 3 until all of them have arrived
  mkdir -p "$PARTS"
  for f in "$WHL"/fa4.tar.xz.part*; do
    if [ -e "$f" ]; then cp "$f" "$PARTS/"; fi
  done
  local need have
  need=$(cat "$WHL/fa4.parts")
  have=$(find "$PARTS" -name 'fa4.tar.xz.part*' | wc -l)
  if [ "$have" -lt "$need" ]; then
    echo "fa4: $have of $need parts stored in $PARTS; carry the next one while the machine is warm"
    exit 3
  fi
  cat "$PARTS"/fa4.tar.xz.part* > /tmp/fa4.tar.xz
  (cd /tmp && sha256sum -c --quiet) < "$WHL/fa4.sha256"
}

site_path() {  # what PYTHONPATH needs for the installed set (see install)
  echo "$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages"
}

install() {
  gather
  rm -rf "$SITE" /tmp/fa4_wheels && mkdir -p /tmp/fa4_wheels
  python3 -c "import lzma, sys, tarfile; tarfile.open(fileobj=lzma.open(sys.argv[1])).extractall(sys.argv[2], filter='data')" \
    /tmp/fa4.tar.xz /tmp/fa4_wheels
  # ONE pip call: libs-base, libs-core and libs-cu13 all install into the top-level dir nvidia_cutlass_dsl/,
  # and a second `pip --target` call skips that existing dir (or, with --upgrade, deletes and replaces it).
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" /tmp/fa4_wheels/*.whl
  rm -rf /tmp/fa4.tar.xz /tmp/fa4_wheels
  # nvidia_cutlass_dsl_packages.pth puts dsl_packages/ (where `cutlass` lives) on sys.path, but .pth files
  # are read only in site dirs, never in a PYTHONPATH entry: name that dir ourselves.
  export PYTHONPATH="$(site_path)${PYTHONPATH:+:$PYTHONPATH}"
  echo "fa4: installed in $SITE ($(du -sh "$SITE" | cut -f1)); PYTHONPATH=$PYTHONPATH"
}

smoke() {  # paged varlen forward (page 16, GQA, a decode row + a chunk over a cached prefix) vs SDPA, bf16
  python3 - <<'PY'
import time, torch
import cutlass, cutlass.cute
from flash_attn.cute import flash_attn_varlen_func
torch.manual_seed(0)
dev, P, Hq, Hkv, D = "cuda", 16, 8, 2, 128
seq_lens, query_lens = [300, 200], [1, 64]
pages = [(L + P - 1) // P for L in seq_lens]
perm = torch.randperm(sum(pages) + 4, device=dev).int()
table = torch.zeros(len(pages), max(pages), dtype=torch.int32, device=dev)
table[0, :pages[0]], table[1, :pages[1]] = perm[:pages[0]], perm[pages[0]:sum(pages)]
kc, vc = (torch.randn(len(perm), P, Hkv, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
q = torch.randn(sum(query_lens), Hq, D, device=dev, dtype=torch.bfloat16)
args = dict(cu_seqlens_q=torch.tensor([0, 1, 65], dtype=torch.int32, device=dev),
            seqused_k=torch.tensor(seq_lens, dtype=torch.int32, device=dev), max_seqlen_q=64, max_seqlen_k=300,
            page_table=table, softmax_scale=D ** -0.5, causal=True)
t = time.time(); flash_attn_varlen_func(q, kc, vc, **args); torch.cuda.synchronize(); first = time.time() - t
t = time.time(); out = flash_attn_varlen_func(q, kc, vc, **args); torch.cuda.synchronize(); again = time.time() - t
out = out[0] if isinstance(out, tuple) else out
err, start = 0.0, 0
for b, (L, n) in enumerate(zip(seq_lens, query_lens)):
    k, v = (c[table[b, :pages[b]].long()].reshape(-1, Hkv, D)[:L].transpose(0, 1) for c in (kc, vc))
    allow = torch.arange(L, device=dev)[None, :] <= torch.arange(L - n, L, device=dev)[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), k, v,
                                                           attn_mask=allow, enable_gqa=True).transpose(0, 1)
    err = max(err, (out[start:start + n].float() - ref.float()).abs().max().item())
    start += n
print(f"fa4 smoke: {torch.cuda.get_device_name()}: first call {first:.1f} s (JIT compile), then "
      f"{1e3 * again:.2f} ms; max |fa4 - sdpa| = {err:.4f}")
assert err < 2e-2, "FA4 disagrees with SDPA"
PY
}

if [ "${1:-}" = pack ]; then
  pack "${2:-1}"
  exit
fi
if [ "${1:-}" = path ]; then  # for a caller that runs FA4 later, after this script has installed it
  site_path
  exit
fi
install
if [ "${FA4_SMOKE:-1}" = 1 ]; then smoke; fi
if [ $# -gt 0 ]; then exec "$@"; fi
