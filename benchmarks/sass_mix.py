"""Instruction mix of the batch-1 gemv's inner loop, compiled for sm_90 on this machine (no GPU needed).

On the H200 the batch-1 gemvs are issue-bound (benchmarks/RESULTS.md, session 28): their time is their instruction
count over ~0.5 issued warps a scheduler-cycle. This compiles `gemv._gemv_kernel` for one width class and launch
setting, disassembles it with the `nvdisasm` Triton ships, finds each loop (a backward branch to a label) and
prints per loop iteration: SASS instructions a thread, words a thread, instructions a word, and the opcode counts.

    python3 benchmarks/sass_mix.py                          # 4-bit, the decode defaults (BS 8, BN 64, 4 warps)
    python3 benchmarks/sass_mix.py --bits 3 --bs 16 --warps 8 --top 12
    python3 benchmarks/sass_mix.py --sweep                  # every width over BS 4/8/16 and 4/8 warps, one line each
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from exl2.kernels import gemv as gemv_k  # noqa: E402

_INSN = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s*(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def compile_sass(bits: int, bs: int, bn: int, warps: int, stages: int) -> str:
    """The disassembled SASS of the one-width gemv kernel (packed decoders on, PDL and its prefetch on, no split)."""
    fn = gemv_k._gemv_kernel
    ptrs = {n: "*fp16" for n in ["x_ptr", "out_ptr", "bias_ptr", "sc_ptr", "zr_ptr"]}
    ptrs.update({"x32_ptr": "*i32", "part_ptr": "*fp32", "cnt_ptr": "*i32", "qw_ptr": "*i32", "sg_ptr": "*i32"})
    consts = {f"HAS{b}": b == bits for b in (8, 6, 5, 4, 3, 2)}
    consts.update(HAS_ZEROS=False, HAS_BIAS=False, SPLIT_ON=False, BM=1, BS=bs, BN=bn, RED=4, FAST4=63,
                  STAGES=stages, PDL=True, PREFETCH=64, PART_ONLY=False)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")
             or n == "N"}
    k = triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    tool = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm"))
    if not tool:
        sys.exit("nvdisasm was not found in the Triton installation.")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        return subprocess.run([tool[0], "-c", f.name], capture_output=True, text=True, check=True).stdout


def loops(sass: str) -> list[Counter]:
    """Opcode counts of each loop body (a label up to a branch back to it), `@!PT` no-ops left out."""
    lines = sass.splitlines()
    labels, found = {}, []
    for i, line in enumerate(lines):
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = i
            continue
        ins = _INSN.match(line)
        if ins and ins.group(2) == "BRA":
            target = re.search(r"\((\.L_x_\d+)\)", ins.group(4))
            if target and target.group(1) in labels:  # a backward branch: the loop's end
                body = Counter()
                for body_line in lines[labels[target.group(1)] + 1:i + 1]:
                    b = _INSN.match(body_line)
                    if b and not (b.group(1) or "").strip().startswith("@!PT"):
                        body[b.group(2)] += 1
                found.append(body)
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bits", type=int, default=4, choices=[8, 6, 5, 4, 3, 2])
    p.add_argument("--bs", type=int, default=8, help="32-row steps an iteration")
    p.add_argument("--bn", type=int, default=64, help="columns a program")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=gemv_k.GEMV_STAGES)
    p.add_argument("--top", type=int, default=20, help="opcodes listed")
    p.add_argument("--sweep", action="store_true", help="every width over BS 4/8/16 and 4/8 warps")
    a = p.parse_args()
    cases = ([(b, bs, a.bn, w, a.stages) for b in (8, 6, 5, 4, 3, 2) for bs in (4, 8, 16) for w in (4, 8)]
             if a.sweep else [(a.bits, a.bs, a.bn, a.warps, a.stages)])
    print("| bits | BS | BN | warps | stages | SASS an iteration | words a thread | SASS a word | of which decode* |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for bits, bs, bn, warps, stages in cases:
        body = max(loops(compile_sass(bits, bs, bn, warps, stages)), key=lambda c: sum(c.values()), default=None)
        if body is None:
            print(f"| {bits} | {bs} | {bn} | {warps} | {stages} | no loop found | | | |")
            continue
        total = sum(body.values())
        words = bs * bits * bn / (32 * warps)
        decode = sum(body[op] for op in ("LOP3", "SHF", "PRMT", "HADD2", "HFMA2", "HMUL2", "IADD3"))
        print(f"| {bits} | {bs} | {bn} | {warps} | {stages} | {total} | {words:g} | {total / words:.1f} | "
              f"{decode / words:.1f} |")
        if not a.sweep:
            print("\n" + ", ".join(f"{op} {n}" for op, n in body.most_common(a.top)))
    print("\n* LOP3, SHF, PRMT, HADD2, HFMA2, HMUL2 and IADD3: the decoders' and the step sums' instructions "
          "(IADD3 also counts some address arithmetic).")


if __name__ == "__main__":
    main()
