"""Grouped output-tile order (GROUP_M M-tiles sweep N together, for L2 reuse of the N operand),
shared by the Triton and Gluon GEMM kernels of fp8_gemm and fused_moe."""

import triton
import triton.language as tl


@triton.jit
def tile_of(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid`, GROUP_M M-tiles sweeping N together (L2 reuse of B)."""
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    return pid_m, pid_n


__all__ = ["tile_of"]
