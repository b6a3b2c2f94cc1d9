"""The batch-invariant linear (kernels/invariant_matmul.py): a row's result is bit for bit the same
whatever the number of rows in the call, and close to F.linear. The Triton kernel runs under the
interpreter on CPU (TRITON_INTERPRET=1, set by tests/conftest.py before triton loads) and compiled on
CUDA; the CPU tiles run on the CPU. Under the interpreter tl.dot is made row-exact (tests/conftest.py
`row_exact_dot`), as the GPU's is."""

import pytest
import torch

from chatengine.kernels import invariant_matmul as im
from chatengine.kernels import paged_attention as pa

INTERPRETED = pa.interpreting()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")),
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs compiled CUDA")
    ),
]
CLOSE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def rows_invariant(linear, x, w, b, counts):
    """linear(x[:m]) for each m in counts: every row equal to its row in linear(x), bit for bit, and
    rows that sit at other places of their tile."""
    full = linear(x, w, b)
    for m in counts:
        part = linear(x[:m], w, b)
        assert im.same_bits(part, full[:m]), f"rows of a {m}-row call differ from the {x.shape[0]}-row call"
    shifted = linear(torch.cat([x[5:9], x[:3]]), w, b)  # other rows before them
    assert im.same_bits(shifted[4:], full[:3])
    return full


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [im.NARROW, im.WIDE])
def test_triton_linear_rows_do_not_depend_on_the_batch(device, dtype, bias, config, request):
    if device == "cpu":
        request.getfixturevalue("row_exact_dot")
    torch.manual_seed(0)
    M, K, N = (2048, 2048, 3072) if device == "cuda" else (70, 96, 80)  # K, N not multiples of the tiles
    x = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    counts = [1, 2, 3, 17, 64, 65, 256, 1000] if device == "cuda" else [1, 3, 17, 64, 65]
    full = rows_invariant(lambda *args: im.linear_triton(*args, config=config), x, w, b, counts)
    torch.testing.assert_close(full.float(), im.linear_ref(x, w, b).float(), **CLOSE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [1000, 9000])  # narrow and wide tiles
def test_tiles_chosen_by_the_rows_keep_rows_invariant(device, N, request):
    """The tiles (and the load path) change with M (config_for); a row's bits do not, across every
    boundary of the rules: 1..64, ..SMALL_ROWS, ..MID_ROWS, ..LARGE_ROWS (CUDA), beyond, below and
    from TMA_FROM_ROWS."""
    if device == "cpu":
        request.getfixturevalue("row_exact_dot")
    torch.manual_seed(4)
    M, K = (2100, 1024) if device == "cuda" else (300, 128)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N if device == "cuda" else N // 50, K, device=device) / K**0.5).to(dtype)
    counts = [1, 2, 31, 32, 33, 64, 65, 128, 129, 200, 256, 257] + ([2047] if device == "cuda" else [])
    width = w.shape[0] * (50 if device == "cpu" else 1)  # CPU: the rules of the full width, small shapes
    assert len({im.config_for(width, m) for m in counts + [M]}) >= 2

    def chosen(x, w, b, segments=1):
        return im.linear_triton(x, w, b, im.config_for(width, x.shape[0]), segments)

    rows_invariant(chosen, x, w, None, counts)
    rows_invariant(lambda x, w, b: chosen(x, w, b, segments=2), x, w, None, counts)


@pytest.mark.parametrize("device", DEVICES)
def test_the_start_check_finds_rows_keep_their_bits_on_every_path(device, request):
    """check_tiles (deterministic engines at start) runs each layer every way linear_triton would
    across M (tiles, load path, segments apart) and finds the first rows' fp32 sums the same."""
    if device == "cpu":
        request.getfixturevalue("row_exact_dot")
    torch.manual_seed(5)
    K, N = (2048, 3072) if device == "cuda" else (64, 32)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    b = torch.randn(N, device=device).to(dtype)
    ms = im.paths(N, N, 2, torch.device(device))
    assert len(ms) >= 3 and ms[0] == 1  # tiles by M, the TMA from TMA_FROM_ROWS, segments apart and not
    assert im.paths(N, N, 2, torch.device(device), by_rows=False) == [1]
    assert im.check_tiles([(w, None, N, 1), (w, None, N, 2), (w, b, 9000, 1)], devices=(device,))


def drifting(real, when):
    """linear_triton on a device whose sums move with the batch size where `when`(M, by_rows)."""

    def call(x, *args, by_rows=True, **kw):
        y = real(x, *args, by_rows=by_rows, **kw)
        return y + 1e-3 if when(x.shape[0], by_rows) else y

    return call


def test_a_failed_start_check_runs_the_layers_one_way_for_every_m(monkeypatch):
    """A device where a larger call moves a row's sums: check_tiles says so, and with by_rows False
    the layer runs one configuration, the pointer kernel and its segments in one program for every
    M (invariant by construction); where even that moves, deterministic mode refuses to start."""
    monkeypatch.setattr(im, "linear_triton", drifting(im.linear_triton, lambda m, by_rows: by_rows and m >= 65))
    w = torch.randn(32, 64)
    assert not im.check_tiles([(w, None, 32, 1)], devices=("cpu",))
    assert {im.config_for(3000, m, by_rows=False) for m in (1, 64, 65, 256, 4096)} == {im.NARROW}
    assert {im.config_for(9000, m, by_rows=False) for m in (1, 64, 65, 256, 4096)} == {im.WIDE}
    monkeypatch.setattr(im, "linear_triton", drifting(im.linear_triton, lambda m, by_rows: m >= 2))
    with pytest.raises(RuntimeError, match="rows move with M"):
        im.check_tiles([(w, None, 32, 1)], devices=("cpu",))


def test_same_bits_tells_minus_zero_from_zero():
    assert im.same_bits(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]))
    assert not im.same_bits(torch.tensor([-0.0]), torch.tensor([0.0]))  # torch.equal says equal
    assert not im.same_bits(torch.tensor([0.0]).bfloat16(), torch.tensor([0.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_torch_linear_rows_do_not_depend_on_the_batch(dtype):
    """The CPU path: plain F.linear is not invariant in fp32 (BLAS picks by M); the tiles are."""
    torch.manual_seed(0)
    x, w, b = torch.randn(150, 576).to(dtype), torch.randn(1536, 576).to(dtype), torch.randn(1536).to(dtype)
    full = rows_invariant(im.linear_tiled_torch, x, w, b, [1, 2, 15, 16, 17, 33, 100])
    torch.testing.assert_close(full, im.linear_ref(x, w, b), **CLOSE[dtype])


def _two_halves(linear, x, w, dtype):
    """segments=2 against the two halves of K computed apart (fp32 results) and added in fp32."""
    h = x.shape[1] // 2
    whole = linear(x, w, segments=2)
    halves = [linear(x[:, s * h : (s + 1) * h], w[:, s * h : (s + 1) * h], out_dtype=torch.float32) for s in (0, 1)]
    assert whole.dtype == dtype
    assert im.same_bits(whole, (halves[0] + halves[1]).to(dtype))
    torch.testing.assert_close(whole.float(), im.linear_ref(x, w).float(), **CLOSE[dtype])
    rows_invariant(lambda x, w, b: linear(x, w, b, segments=2), x, w, None, [1, 3, 17])


@pytest.mark.parametrize(
    "device, dtype",
    [
        # the interpreter rounds fp32 -> bf16 by truncation, compiled Triton to nearest: fp32 here
        pytest.param("cpu", torch.float32, marks=DEVICES[0].marks),
        pytest.param("cuda", torch.float32, marks=DEVICES[1].marks),
        pytest.param("cuda", torch.bfloat16, marks=DEVICES[1].marks),
    ],
)
def test_triton_two_segments_are_the_sum_of_the_halves_in_fp32(device, dtype, request):
    """segments=2: exactly what two tensor-parallel ranks get from their halves of K, summed in fp32
    and rounded once -- and still row-invariant."""
    if device == "cpu":
        request.getfixturevalue("row_exact_dot")
    torch.manual_seed(1)
    M, K, N = (300, 4096, 1024) if device == "cuda" else (40, 160, 48)  # halves of 80: not whole tiles
    x = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    _two_halves(im.linear_triton, x, w, dtype)


@pytest.mark.parametrize(
    "device, dtype",
    [
        pytest.param("cpu", torch.float32, marks=DEVICES[0].marks),
        pytest.param("cuda", torch.float32, marks=DEVICES[1].marks),
        pytest.param("cuda", torch.bfloat16, marks=DEVICES[1].marks),
    ],
)
def test_segments_in_programs_of_their_own_give_the_one_programs_bits(device, dtype, request, monkeypatch):
    """A call with too few tiles runs each segment of K in programs of its own and adds their fp32
    sums after: the same bits as one program walking both (with a bias, and fp32 results too)."""
    if device == "cpu":
        request.getfixturevalue("row_exact_dot")
    torch.manual_seed(2)
    M, K, N = (300, 4096, 1024) if device == "cuda" else (40, 160, 48)
    x = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    b = torch.randn(N, device=device).to(dtype)
    got = {}
    for name, below in (("one program", 0), ("apart", 10**9)):
        monkeypatch.setattr(im, "split_below", lambda device, below=below: below)
        got[name] = [im.linear_triton(x, w, b, segments=2), im.linear_triton(x, w, segments=2, out_dtype=torch.float32)]
    for one, apart in zip(got["one program"], got["apart"], strict=True):
        assert im.same_bits(one, apart)
    assert got["apart"][1].dtype == torch.float32
    torch.testing.assert_close(got["apart"][0].float(), im.linear_ref(x, w, b).float(), **CLOSE[dtype])


@pytest.mark.parametrize(
    "device, dtype",
    [
        pytest.param("cpu", torch.float32, marks=DEVICES[0].marks),
        pytest.param("cuda", torch.float32, marks=DEVICES[1].marks),
        pytest.param("cuda", torch.bfloat16, marks=DEVICES[1].marks),
    ],
)
@pytest.mark.parametrize("segments, below", [(1, 0), (2, 0), (2, 10**9)])
def test_tma_kernel_gives_the_pointer_kernels_bits(device, dtype, segments, below, request, monkeypatch):
    """Tiles loaded by the TMA (rows past M zero-filled by it) and by pointer loads: the same
    products in the same order, so the same bits -- segments in one program or apart, with a bias
    and without. (K steps that do not divide a segment take the pointer kernel's masked loads: the
    tests above, whose K is no multiple of the tiles.)"""
    if device == "cpu":
        request.getfixturevalue("row_exact_dot")
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("no TMA before sm_90")
    monkeypatch.setattr(im, "split_below", lambda device: below)
    torch.manual_seed(3)
    M, K, N = (300, 2048, 1000) if device == "cuda" else (70, 256, 80)  # M, N not whole tiles
    x = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    b = torch.randn(N, device=device).to(dtype)
    assert im.tma_fits(x, w, 64, K // segments)
    for bias in (None, b):
        tma = im.linear_triton(x, w, bias, config=im.NARROW, segments=segments, tma=True)
        pointer = im.linear_triton(x, w, bias, config=im.NARROW, segments=segments, tma=False)
        assert im.same_bits(tma, pointer)
    torch.testing.assert_close(tma.float(), im.linear_ref(x, w, b).float(), **CLOSE[dtype])
    assert not im.tma_fits(x[:, 1:129], w, 64, 128)  # an unaligned base
    assert not im.tma_fits(torch.empty(M, K + 1, device=device, dtype=dtype)[:, :K], w, 64, K)  # row stride


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_torch_two_segments_are_the_sum_of_the_halves_in_fp32(dtype):
    """The CPU path: each half in x's dtype, the two added in fp32, rounded once."""
    torch.manual_seed(1)
    x, w = torch.randn(40, 160).to(dtype), (torch.randn(48, 160) / 160**0.5).to(dtype)
    _two_halves(im.linear_tiled_torch, x, w, dtype)


def test_linear_keeps_leading_dims():
    x, w = torch.randn(2, 5, 8), torch.randn(3, 8)
    assert im.linear(x, w).shape == (2, 5, 3)
    assert im.config_for(2048, 1000) == im.NARROW and im.config_for(128256, 1000) == im.WIDE
    assert im.config_for(2048, 2048) == im.WIDE and im.config_for(128256, 128) == im.WIDE
    assert im.config_for(2048, 128) == im.SMALL_NARROW and im.config_for(2048, 129) == im.MID_NARROW
    assert im.config_for(16384, 64) == im.SMALL_WIDE and im.config_for(16384, 65) == im.MID_WIDE
    assert im.config_for(16384, 129) == im.WIDE
    torch.testing.assert_close(im.linear(x, w), im.linear_ref(x, w))


def test_a_launch_takes_the_pipeline_stages_that_fit():
    """A config whose stages overflow the device's shared memory (fp32 operands take twice bf16's
    room) launches with fewer, as many as fit, and later calls start there; where one stage does not
    fit, the error stands."""

    class Kernel:
        def __init__(self, fits):
            self.fits, self.tried = fits, []

        def __getitem__(self, grid):
            def launch(*args, num_stages, **kw):
                self.tried.append(num_stages)
                if num_stages > self.fits:
                    raise im.OutOfResources(1, 0, "shared memory")

            return launch

    kernel = Kernel(fits=2)
    common = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, num_stages=4)
    im._launch_fitted(kernel, (1, 1), (), common, (torch.float32, torch.float32))
    im._launch_fitted(kernel, (1, 1), (), common, (torch.float32, torch.float32))
    assert kernel.tried == [4, 3, 2, 2]
    im._launch_fitted(kernel, (1, 1), (), common, (torch.bfloat16, torch.bfloat16))  # another key
    assert kernel.tried[4:] == [4, 3, 2]
    with pytest.raises(im.OutOfResources):
        im._launch_fitted(Kernel(fits=0), (1, 1), (), common, (torch.float32, torch.float32))
