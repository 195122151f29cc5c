"""How many of the instructions forerun's native kernels are made of this
CPU runs per cycle on one thread: the ceiling a kernel's instruction mix
sets, whatever its memory traffic.

    python benchmarks/vector_throughput.py

It compiles a small C program (with ``cc``), measures the clock with a
chain of dependent integer adds (one a cycle on every x86-64 core of the
last decade), then times 12 independent copies of each instruction in a
loop: the 256-bit byte products of the 4-, 6- and 8-bit kernels
(``vpmaddubsw``), their int16 sums (``vpaddw``) and int32 pairing
(``vpmaddwd``), a bitwise ``vpand`` (the 4-bit unpacking), float FMAs
(attention, the activation scales) and 256-bit loads.  Each figure is
instructions per cycle, the best of 5 runs.

A kernel's instructions per 256 weights and one row of activations,
divided by these rates, give the fewest cycles it can take.  The q4 kernel
on AVX2 runs, per 256 weights and row, 8 vpmaddubsw, 8 vpaddw, a vpmaddwd,
a conversion, a multiply and 2 FMAs, its share of the unpacking, and about
10 loads (8 of activations, 2 of their scales), besides any registers the
compiler spills.

Run it on an idle machine (nothing else running): every figure is a time.
On a VM, a busy sibling hyperthread halves what it shows.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from harness import machine_line, parser

REGISTERS = 12

# name, the instruction with {r} for the destination register number
INSTRUCTIONS = (
    ("vpmaddubsw ymm", "vpmaddubsw %%ymm14, %%ymm15, %%ymm{r}"),
    ("vpaddw ymm", "vpaddw %%ymm14, %%ymm15, %%ymm{r}"),
    ("vpmaddwd ymm", "vpmaddwd %%ymm14, %%ymm15, %%ymm{r}"),
    ("vpand ymm", "vpand %%ymm14, %%ymm15, %%ymm{r}"),
    ("vfmadd231ps ymm", "vfmadd231ps %%ymm14, %%ymm15, %%ymm{r}"),
    ("256-bit load", "vmovdqu (%0), %%ymm{r}"),
)

PROGRAM = r"""
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec;
}
static char buffer[4096] __attribute__((aligned(64)));
#define CLOBBER "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9", \
                "xmm10","xmm11","xmm14","xmm15"
/* zeroed sources (a zeroing idiom takes no execution unit) */
#define SOURCES "vpxor %%ymm14, %%ymm14, %%ymm14\n\tvpxor %%ymm15, %%ymm15, %%ymm15\n\t"
int main(void) {
    const long n = 20000000;
    double best = 1e9;
    for (int run = 0; run < 5; run++) {
        long left = 4 * n;
        long x = 0;
        const double t0 = now();
        __asm__ volatile("1:\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                         "sub $4, %1\n\tjnz 1b" : "+r"(x), "+r"(left));
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    const double ghz = 4.0 * n / best / 1e9;
    printf("clock %.3f\n", ghz);
    BODIES
    return 0;
}
"""

BODY = r"""
    {
        double best = 1e9;
        for (int run = 0; run < 5; run++) {
            const double t0 = now();
            for (long i = 0; i < n; i++)
                __asm__ volatile(SOURCES ASM :: "r"(buffer) : CLOBBER);
            const double dt = now() - t0;
            if (dt < best) best = dt;
        }
        printf("%s %.3f\n", NAME, (double)REGISTERS * n / (best * ghz * 1e9));
    }
"""


def program() -> str:
    bodies = []
    for name, instruction in INSTRUCTIONS:
        asm = "".join(f'"{instruction.format(r=r)}\\n\\t"' for r in range(REGISTERS))
        bodies.append(BODY.replace("ASM", asm).replace("NAME", f'"{name.replace(" ", "_")}"')
                      .replace("REGISTERS", str(REGISTERS)))
    return PROGRAM.replace("BODIES", "".join(bodies))


def main() -> None:
    parser(__doc__).parse_args()
    if platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit("this measures x86-64 instructions; the machine is "
                         f"{platform.machine()}")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc or gcc) was found")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "throughput.c", Path(tmp) / "throughput"
        source.write_text(program())
        subprocess.run([compiler, "-O2", str(source), "-o", str(binary)], check=True)
        lines = subprocess.run([str(binary)], check=True, capture_output=True,
                               text=True).stdout.split("\n")
    values = dict(line.split() for line in lines if line.strip())
    print(machine_line(f"one thread, clock {float(values.pop('clock')):.2f} GHz (from "
                       "dependent adds)", torch_info=False))
    print(f"{'instruction':18} {'per cycle':>9}")
    for name, rate in values.items():
        print(f"{name.replace('_', ' '):18} {float(rate):9.2f}")


if __name__ == "__main__":
    main()
