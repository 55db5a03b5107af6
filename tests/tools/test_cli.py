"""The ``flexc`` command: ``trace`` prints traced expressions, ``show`` prints generated kernels."""
from __future__ import annotations

import shlex
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import flexc
from flexc.tools.cli import main
from repo import ROOT

MODS = textwrap.dedent('''
    import torch
    slopes = torch.exp2(-torch.arange(1, 5).float())

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def generate_sliding_window(window):
        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)
        return sliding_window
''')


@pytest.fixture()
def mods_file(tmp_path):
    path = tmp_path / "mods.py"
    path.write_text(MODS)
    return str(path)


def test_trace_prints_every_mod_and_its_captured_tensors(mods_file, capsys):
    assert main(["trace", mods_file]) == 0
    out = capsys.readouterr().out
    assert "alibi (score_mod): score + slopes[h] * (kv_idx - q_idx)" in out
    assert "slopes: [4] float32" in out
    assert "causal (mask_mod): q_idx >= kv_idx" in out


def test_trace_evaluates_an_expression_in_the_file(mods_file, capsys):
    assert main(["trace", f"{mods_file}:generate_sliding_window(128)"]) == 0
    assert "(q_idx >= kv_idx) & (q_idx - kv_idx <= 128)" in capsys.readouterr().out


def test_show_prints_the_source_kernel_source_returns(mods_file, capsys):
    assert main(["show", f"{mods_file}:alibi,causal", "--device", "cpu", "--dtype", "float32",
                 "--head-dim", "16", "--block-size", "32", "-o", "BLOCK_M=32", "-o", "BLOCK_N=32",
                 "--q-len", "64", "--heads", "4"]) == 0
    shown = capsys.readouterr().out
    namespace = {}
    exec(MODS, namespace)
    q = k = v = torch.randn(1, 4, 64, 16)
    block_mask = flexc.create_block_mask(namespace["causal"], None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    expected = flexc.kernel_source(q, k, v, score_mod=namespace["alibi"], block_mask=block_mask,
                                   kernel_options={"BACKEND": "TRITON", "BLOCK_M": 32, "BLOCK_N": 32})
    assert shown == expected


@pytest.mark.parametrize("flags", [["--q-len", "1", "--lse"], ["--q-len", "16", "--training"],
                                   ["--q-len", "16", "--backward"], ["--q-len", "40", "--lse"]])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_show_prints_the_kernels_the_call_it_describes_launches(mods_file, capsys, flags, device):
    """Decoding's two kernels, training's forward and backward: what kernel_source returns for that
    call (its CUDA source under a simulated GPU for --device cuda)."""
    assert main(["show", f"{mods_file}:alibi,causal", "--device", device, "--dtype", "float32", "--head-dim", "16",
                 "--kv-len", "64", "--heads", "4", "--kv-heads", "2", "--block-size", "32", *flags]) == 0
    shown = capsys.readouterr().out
    namespace = {}
    exec(MODS, namespace)
    L = int(flags[1])
    training = "--training" in flags or "--backward" in flags
    q = torch.randn(1, 4, L, 16, requires_grad=training)
    k = v = torch.randn(1, 2, 64, 16, requires_grad=training)
    block_mask = flexc.create_block_mask(namespace["causal"], None, None, L, 64, device="cpu", BLOCK_SIZE=32)
    with flexc.device.simulate("sm_90" if device == "cuda" else None):
        expected = flexc.kernel_source(q, k, v, score_mod=namespace["alibi"], block_mask=block_mask, enable_gqa=True,
                                       return_lse="--lse" in flags, kernel_options={"BACKEND": "TRITON"},
                                       backward="--backward" in flags)
    assert shown == expected
    assert ("flex_decode_merge" in shown) == (L == 1)  # decoding launches two kernels; training does not
    assert ("target: cuda" in shown) == (device == "cuda")


def _expected_source(device: str, L: int, training: bool, **call) -> str:
    """kernel_source of the call `flexc show mods.py:alibi,causal --kv-len 64 --heads 4 --kv-heads 2` describes."""
    namespace = {}
    exec(MODS, namespace)
    q = torch.randn(1, 4, L, 16, requires_grad=training)
    k = v = torch.randn(1, 2, 64, 16, requires_grad=training)
    block_mask = flexc.create_block_mask(namespace["causal"], None, None, L, 64, device="cpu", BLOCK_SIZE=32)
    with flexc.device.simulate("sm_90" if device == "cuda" else None), warnings.catch_warnings():
        warnings.simplefilter("ignore", flexc.FallbackWarning)
        return flexc.kernel_source(q, k, v, score_mod=namespace["alibi"], block_mask=block_mask, enable_gqa=True,
                                   kernel_options={"BACKEND": "TRITON"}, **call)


def _show(mods_file, capsys, device: str, L: int, *flags) -> tuple[str, str]:
    assert main(["show", f"{mods_file}:alibi,causal", "--device", device, "--dtype", "float32", "--head-dim", "16",
                 "--q-len", str(L), "--kv-len", "64", "--heads", "4", "--kv-heads", "2", "--block-size", "32",
                 *flags]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.parametrize("flags", [[], ["--training"], ["--backward"]])
@pytest.mark.parametrize("L,device", [(40, "cpu"), (1, "cuda")])
def test_show_sinks_prints_the_kernels_that_fold_the_sinks(mods_file, capsys, flags, L, device):
    shown, err = _show(mods_file, capsys, device, L, "--sinks", *flags)
    training = bool(flags)
    sinks = torch.zeros(4, requires_grad=training)
    backward = "--backward" in flags
    assert shown == _expected_source(device, L, training, sinks=sinks, backward=backward) and err == ""
    without = _expected_source(device, L, training, return_lse=True, backward=backward)
    if backward:  # the forward's statistics include the sinks: the backward kernel is the sink-free one
        assert shown == without
    else:  # the forward kernel (or the decode kernel's merge) starts each row's softmax from its sink
        assert "sink" in shown and "sink" not in without


@pytest.mark.parametrize("flags", [[], ["--backward"]])
def test_show_dropout_prints_the_dropout_kernels(mods_file, capsys, flags):
    shown, err = _show(mods_file, capsys, "cuda", 40, "--dropout", "0.2", *flags)
    assert shown == _expected_source("cuda", 40, bool(flags), dropout_p=0.2, backward=bool(flags))
    assert "def dropout_keep(" in shown and err == ""
    plain = _show(mods_file, capsys, "cuda", 40, *flags)[0]
    assert _show(mods_file, capsys, "cuda", 40, "--dropout", "0", *flags)[0] == plain and "dropout" not in plain


def test_show_defaults_to_the_cuda_kernel_of_the_files_mods(mods_file, capsys):
    assert main(["show", mods_file, "--head-dim", "128"]) == 0
    out = capsys.readouterr().out
    assert "target: cuda" in out and "BLOCK_M=128, BLOCK_N=64; num_warps=8" in out
    # slopes[h] is one value per program: the kernel loads it once and the score_mod takes the value
    assert "def score_mod(score, b, h, q_idx, kv_idx, slopes_at_h):" in out
    assert "slopes_at_h = tl.load(slopes_ptr + h * slopes_stride_0)" in out


@pytest.mark.parametrize("target,message", [
    ("{path}:missing", "defines no 'missing'. Mods defined there: alibi, causal"),
    ("{path}:slopes", "is not a score_mod"),
    ("{path}:generate_sliding_window(", "evaluating"),
    ("/no/such/file.py", "no such file"),
])
def test_errors_name_the_problem_and_exit_2(mods_file, capsys, target, message):
    assert main(["show", target.format(path=mods_file)]) == 2
    assert message in capsys.readouterr().err


def test_bad_kernel_option_is_reported(mods_file, capsys):
    assert main(["show", f"{mods_file}:causal", "--block-size", "96", "-o", "BLOCK_M=64"]) == 2
    assert "must be a multiple of kernel_options['BLOCK_M']=64" in capsys.readouterr().err


def test_console_script_module_runs(mods_file):
    done = subprocess.run([sys.executable, "-m", "flexc", "trace", f"{mods_file}:causal"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "causal (mask_mod): q_idx >= kv_idx"


@pytest.mark.parametrize("argv,status,answer", [
    (["--help"], 0, "usage: flexc"),
    (["--version"], 0, f"flexc {flexc.__version__} (torch {torch.__version__})"),
    (["show", "examples/mods.py:causal", "--head-dim", "0"], 2, "--head-dim must be >= 1, got 0"),
    (["show", "no_such_file.py:causal"], 2, "no such file: 'no_such_file.py'"),
])
def test_the_command_answers_help_version_and_bad_input_without_importing_torch(argv, status, answer):
    """`python -m flexc --help` answers in a fraction of a second: torch (about 1 s) is never imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "flexc", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == status and answer in done.stdout + done.stderr, done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "flexc.tools.cli" in imported and "torch" not in imported


def test_the_readmes_show_example_prints_the_kernel_of_the_mods_it_names(capsys, monkeypatch):
    """README's `flexc show examples/mods.py:...` line, run as written from the checkout's root."""
    line = next(s for s in (ROOT / "README.md").read_text().splitlines() if s.startswith("flexc show"))
    argv = shlex.split(line, comments=True)[1:]
    monkeypatch.chdir(ROOT)
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith("# flexc forward attention kernel")
    for name in argv[1].partition(".py:")[2].split(","):
        assert f" {name}: " in out.split("\n\n")[0], name  # the header names each traced mod


# ---- argument validation: every argument checked as flex_attention checks its inputs ----------

@pytest.mark.parametrize("argv,message", [
    (["--head-dim", "-5"], "--head-dim must be >= 1, got -5"),
    (["--head-dim", "0"], "--head-dim must be >= 1, got 0"),
    (["--v-head-dim", "0"], "--v-head-dim must be >= 1, got 0"),
    (["--head-dim", "x"], "--head-dim takes a positive integer, got 'x'"),
    (["--block-size", "0"], "--block-size takes N or Q,KV with positive sizes"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5. Fix: pass e.g. --dropout 0.1"),
    (["--dropout", "-0.1"], "--dropout must be in [0, 1), got -0.1. Fix"),
    (["--dropout", "nan"], "--dropout must be in [0, 1), got nan. Fix"),
    (["--dropout", "x"], "--dropout takes a probability in [0, 1), got 'x'. Fix: pass e.g. --dropout 0.1"),
])
def test_show_rejects_bad_sizes_before_generating_anything(mods_file, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["show", f"{mods_file}:alibi,causal", *argv])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_show_rejects_kernel_options_flex_attention_rejects(mods_file, capsys):
    assert main(["show", f"{mods_file}:causal", "-o", "FOO=1"]) == 2
    err = capsys.readouterr().err
    assert "-o/--option: unknown kernel_options key 'FOO'" in err
    with pytest.raises(ValueError, match="unknown kernel_options key 'FOO'"):  # the same rule in the call
        q = torch.randn(1, 1, 16, 16)
        flexc.flex_attention(q, q, q, kernel_options={"FOO": 1})


def test_a_bad_power_of_two_option_suggests_the_next_power_of_two(mods_file, capsys):
    assert main(["show", f"{mods_file}:causal", "-o", "num_warps=3"]) == 2
    assert "kernel_options['num_warps'] must be a power of two >= 1, got 3. Fix: use e.g. 4." in capsys.readouterr().err
    assert main(["show", f"{mods_file}:causal", "-o", "BLOCK_M=48"]) == 2
    assert "got 48. Fix: use e.g. 64." in capsys.readouterr().err


def test_block_size_without_a_mask_mod_is_an_error_not_ignored(mods_file, capsys):
    assert main(["show", f"{mods_file}:alibi", "--block-size", "64"]) == 2
    assert "--block-size sets the BlockMask's block size, but no mask_mod was given" in capsys.readouterr().err


# ---- files and mods that fail --------------------------------------------------------------

def test_trace_reports_each_failing_mod_and_still_prints_the_others(tmp_path, capsys):
    path = tmp_path / "some_bad.py"
    path.write_text(MODS + textwrap.dedent('''
        def branchy(b, h, q_idx, kv_idx):
            if q_idx > 3:
                return q_idx >= kv_idx
            return q_idx < kv_idx
    '''))
    assert main(["trace", str(path)]) == 2
    captured = capsys.readouterr()
    assert "alibi (score_mod):" in captured.out and "causal (mask_mod): q_idx >= kv_idx" in captured.out
    assert "flexc trace: branchy: cannot trace mask_mod branchy" in captured.err
    assert main(["trace", f"{path}:causal,missing,alibi"]) == 2
    captured = capsys.readouterr()
    assert "causal (mask_mod)" in captured.out and "alibi (score_mod)" in captured.out
    assert "flexc trace: missing: " in captured.err and "defines no 'missing'" in captured.err


@pytest.mark.parametrize("source,message", [
    ("def causal(b, h, q_idx, kv_idx:\n    return q_idx >= kv_idx\n", "does not import: SyntaxError at line 1"),
    ("import no_such_module_for_flexc\n", "does not import: ModuleNotFoundError: No module named "
                                          "'no_such_module_for_flexc'"),
    ("raise RuntimeError('boom')\n", "does not import: RuntimeError: boom"),
    ("import sys\nsys.exit(3)\n", "does not import: SystemExit: 3"),
])
def test_a_file_that_does_not_import_gives_one_clean_line(tmp_path, capsys, source, message):
    path = tmp_path / "broken.py"
    path.write_text(source)
    for command in ("trace", "show"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


# ---- version and pictures -------------------------------------------------------------------

def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"flexc {flexc.__version__} (torch {torch.__version__})"


def test_draw_writes_the_png_plot_writes(mods_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "drawn.png"
    assert main(["draw", f"{mods_file}:alibi,causal", "--png", str(out), "--q-len", "200", "--kv-len", "300",
                 "--block-size", "64", "-H", "4", "--head", "2", "--dpi", "40"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    namespace = {}
    exec(MODS, namespace)
    expected = tmp_path / "expected.png"
    block_mask = flexc.create_block_mask(namespace["causal"], 1, 4, 200, 300, device="cpu", BLOCK_SIZE=64)
    flexc.plot(namespace["alibi"], 1, 4, 200, 300, mask_mod=block_mask, head=2, path=str(expected), dpi=40)
    assert out.read_bytes() == expected.read_bytes()


@pytest.mark.parametrize("argv,message", [
    (["--head", "4", "-H", "4"], "--head 4 is out of range for -H 4"),
    (["--batch", "1"], "--batch 1 is out of range for -B 1"),
])
def test_draw_rejects_selections_outside_the_problem(mods_file, tmp_path, capsys, argv, message):
    assert main(["draw", f"{mods_file}:causal", "--png", str(tmp_path / "x.png"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


# ---- bad input never ends in a traceback ------------------------------------------------------

RAISING = textwrap.dedent('''
    import torch
    table = torch.zeros(4)

    def raising_score(score, b, h, q_idx, kv_idx):
        raise RuntimeError("boom in the score_mod")

    def raising_mask(b, h, q_idx, kv_idx):
        raise ValueError("boom in the mask_mod")

    def short_table(score, b, h, q_idx, kv_idx):
        return score + table[q_idx]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
''')


@pytest.fixture()
def raising_file(tmp_path):
    path = tmp_path / "raising.py"
    path.write_text(RAISING)
    return str(path)


def _one_clean_error(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    assert "\nFix: " in captured.err or ". Fix: " in captured.err, captured.err
    return captured.err


@pytest.mark.parametrize("command", ["show", "trace", "draw"])
@pytest.mark.parametrize("name,raised,line", [
    ("raising_score", "RuntimeError: boom in the score_mod", 'raise RuntimeError("boom in the score_mod")'),
    ("raising_mask", "ValueError: boom in the mask_mod", 'raise ValueError("boom in the mask_mod")'),
])
def test_a_mod_that_raises_names_its_exception_and_line_not_a_traceback(raising_file, tmp_path, capsys,
                                                                        command, name, raised, line):
    extra = ["--png", str(tmp_path / "x.png")] if command == "draw" else []
    assert main([command, f"{raising_file}:{name}", *extra]) == 2
    err = _one_clean_error(capsys)
    assert f"cannot trace {'score' if 'score' in name else 'mask'}_mod {name}: it raised {raised}" in err
    assert f"({raising_file}:" in err and line in err
    assert f"Fix: make {name} run on tensor arguments without raising" in err
    assert not (tmp_path / "x.png").exists()


def test_draw_into_a_missing_folder_says_which_folder(mods_file, tmp_path, capsys):
    target = tmp_path / "missing_dir" / "x.png"
    assert main(["draw", f"{mods_file}:causal", "--png", str(target), "--q-len", "64"]) == 2
    err = _one_clean_error(capsys)
    assert f"the folder '{tmp_path / 'missing_dir'}' does not exist" in err and "mkdir -p" in err


def test_draw_onto_a_folder_or_an_unknown_file_type_is_an_error(mods_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["draw", f"{mods_file}:causal", "--png", str(tmp_path), "--q-len", "64"]) == 2
    assert "is a folder, not a file name" in _one_clean_error(capsys)
    assert main(["draw", f"{mods_file}:causal", "--png", str(tmp_path / "x.nope"), "--q-len", "64"]) == 2
    assert "got .nope. Fix: name the file e.g." in _one_clean_error(capsys)
    assert not (tmp_path / "x.nope").exists()


def test_draw_of_a_mod_that_fails_at_the_drawn_positions_is_an_error(raising_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["draw", f"{raising_file}:short_table", "--png", str(tmp_path / "x.png"), "--q-len", "64"]) == 2
    err = _one_clean_error(capsys)
    assert "evaluating short_table over 64 x 64 positions raised IndexError" in err
    assert "--q-len 64" in err.split("Fix:")[1]


def test_draw_that_cannot_write_its_file_is_an_error(mods_file, tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Figure, "savefig", refuse)
    assert main(["draw", f"{mods_file}:causal", "--png", str(tmp_path / "x.png"), "--q-len", "64"]) == 2
    assert "cannot write it: Permission denied. Fix: choose a writable location." in _one_clean_error(capsys)


def test_a_flexc_bug_is_one_line_and_exit_1_and_the_traceback_is_on_request(mods_file, capsys, monkeypatch):
    import flexc.tools.cli

    def broken(*args, **kwargs):
        raise KeyError("internal")
    monkeypatch.setattr(flexc.tools.cli, "_find_mods", broken)
    monkeypatch.delenv("FLEXC_TRACEBACK", raising=False)
    assert main(["trace", mods_file]) == 1
    err = capsys.readouterr().err
    assert "flexc trace: internal error: KeyError: 'internal'" in err and "FLEXC_TRACEBACK=1" in err
    assert "Traceback" not in err
    monkeypatch.setenv("FLEXC_TRACEBACK", "1")
    with pytest.raises(KeyError):
        main(["trace", mods_file])
