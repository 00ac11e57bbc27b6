"""benchmarks/ncu_hotspots.py on a small CSV in Nsight Compute's source-page layout."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("ncu_hotspots", os.path.join(ROOT, "benchmarks", "ncu_hotspots.py"))
ncu_hotspots = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_hotspots)

HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'


def write_csv(path):
    rows = ['"Kernel Name","void sptr::<unnamed>::fwd_onehot_kernel<(int)32, __half>(sptr::<unnamed>::Args<T2>)",\n',
            HEADER,
            '"0x0","S2R R0, SR_TID.X","1","10"\n',
            '"0x10","IMAD R1, R0, 0x3, RZ","5","1,000"\n',      # a loop body of three instructions
            '"0x20","LDS R2, [R1]","9","1,000"\n',
            '"0x30","@!P0 BRA 0x10","2","1,000"\n',
            '"0x40","HMMA.16816.F32 R4, R8, R12, RZ","3","100"\n',
            '"0x50","EXIT","0","10"\n',
            # the same kernel's second section (ncu repeats some kernels) is dropped
            '"Kernel Name","void sptr::<unnamed>::fwd_onehot_kernel<(int)32, __half>(sptr::<unnamed>::Args<T2>)",\n',
            HEADER,
            '"0x0","EXIT","0","99"\n']
    path.write_text("".join(rows))


def test_mix_and_hottest_run(tmp_path):
    path = tmp_path / "src.csv"
    write_csv(path)
    kernels = ncu_hotspots.read_kernels(str(path))
    assert [name for name, _ in kernels] == ["fwd_onehot_kernel<(int)32, __half>"]
    name, instrs = kernels[0]
    assert len(instrs) == 6
    hottest = ncu_hotspots.runs(instrs)[0]
    assert hottest == (3000.0, 1, 4)
    text = ncu_hotspots.report(name, instrs, top=2)
    assert "3.12e+03 warp instructions executed" in text
    assert "IMAD 32%" in text and "HMMA 3%" in text
    assert "96.2%  [1, 4) x1000" in text and "LDS R2, [R1]" in text
