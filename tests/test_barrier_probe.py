"""benchmarks/barrier_probe.py's kernels compute what they time: a dependent chain of phases, as separate launches
or as one kernel with a grid barrier between phases (one program here: the interpreter runs programs one at a
time, so a wider grid would wait at its first barrier for programs that never start)."""
import sys
from pathlib import Path

import pytest
import torch

from exl2.kernels.backend import INTERPRET, force_triton, triton_usable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.skipif(not (INTERPRET and triton_usable()), reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("phases", [1, 4, 5])
def test_the_chain_and_the_persistent_kernel_count_their_phases(phases):
    import barrier_probe as bp

    for programs, run in ((3, lambda a, b, c: bp.run_launches(a, b, phases, False)),
                          (1, lambda a, b, c: bp.run_persistent(a, b, c, phases))):
        a = torch.zeros(programs, dtype=torch.int32)
        b = torch.zeros_like(a)
        cnt = torch.full((1,), 7, dtype=torch.int32)  # cleared by run_persistent itself
        with force_triton():
            run(a, b, cnt)
        assert torch.equal(bp.result(a, b, phases), torch.full_like(a, phases))
