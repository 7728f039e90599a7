"""The CLI at start-up: what `pagedserve serve` can find wrong before it starts a process ends it with one
line and exit code 1 (and no child); `pagedserve generate` says what it is doing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve import launcher
from tests.services_harness import free_port

REPO = Path(__file__).resolve().parents[2]


class NoStack:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a child was about to start")


def refused(monkeypatch, capsys, argv: list[str]) -> str:
    """serve's one line for argv, checked to come with exit code 1, before any child starts."""
    monkeypatch.setattr(launcher, "Stack", NoStack)
    try:
        code = launcher.main(argv)
    except SystemExit as exc:  # a flag error: argparse's exit
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.count("\n") == 1, (code, out, err)
    assert err.startswith("pagedserve serve: error: ")
    return err


def test_a_missing_or_unusable_model_directory_is_one_line(tmp_path, monkeypatch, capsys):
    assert "does not exist" in refused(monkeypatch, capsys, ["--model", str(tmp_path / "nope")])
    assert "config.json not found" in refused(monkeypatch, capsys, ["--model", str(tmp_path)])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert "unsupported architecture model_type='gpt2'" in refused(monkeypatch, capsys, [
        "--model", str(tmp_path), "--model-impl", "native"])  # (auto serves it through transformers)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5Model"]}))
    assert "encoder-decoder" in refused(monkeypatch, capsys, ["--model", str(tmp_path)])
    (tmp_path / "config.json").write_text("{not json")
    assert "is not valid JSON" in refused(monkeypatch, capsys, ["--model", str(tmp_path)])


def test_a_quantization_not_built_is_one_line(llama_dir, tmp_path, monkeypatch, capsys):
    import shutil

    shutil.copytree(llama_dir, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    (tmp_path / "q" / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "gptq", "bits": 2, "group_size": 128}}))
    assert "bits 2 is not supported; supported: 4, 8" in refused(monkeypatch, capsys, ["--model", str(tmp_path / "q")])
    assert "--quantization awq needs a checkpoint quantized with it" in refused(monkeypatch, capsys, [
        "--model", str(llama_dir), "--quantization", "awq"])
    assert "invalid choice: 'int3'" in refused(monkeypatch, capsys, ["--model", str(llama_dir), "-q", "int3"])


def test_a_port_in_use_is_named(llama_dir, monkeypatch, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = free_port()
        err = refused(monkeypatch, capsys, ["--model", str(llama_dir), "--port", str(port), "--grpc-port", str(other)])
        assert f"--port (HTTP) {port} on 127.0.0.1" in err and "in use" in err
        err = refused(monkeypatch, capsys, ["--model", str(llama_dir), "--port", str(other), "--grpc-port", str(port)])
        assert f"--grpc-port {port} on 127.0.0.1" in err and "in use" in err
    assert "both" in refused(monkeypatch, capsys, ["--port", str(other), "--grpc-port", str(other)])


def test_flags_a_child_would_refuse_are_one_line(monkeypatch, capsys):
    assert "--block-size must be a power of two" in refused(monkeypatch, capsys, ["--block-size", "3"])
    assert "--max-resumes" in refused(monkeypatch, capsys, ["--max-resumes", "-1"])  # the gateway's own check
    assert "invalid choice: 'foo'" in refused(monkeypatch, capsys, ["--dtype", "foo"])
    assert "unrecognized arguments: --no-such-flag" in refused(monkeypatch, capsys, ["--no-such-flag"])


def test_bad_environment_values_are_one_line(monkeypatch):
    from pagedserve.launcher import build_parser

    for variable, value, expected in [("PAGEDSERVE_PORT", "x", "is not a valid --port"),
                                      ("PAGEDSERVE_DTYPE", "foo", "--dtype must be one of")]:
        monkeypatch.setenv(variable, value)
        with pytest.raises(SystemExit, match=expected):
            build_parser()
        monkeypatch.delenv(variable)
    # compose passes an unset variable as '': a number, a choice or a switch stays at its default, while
    # a free-text flag whose default is not empty takes '' (--allowed-origins '': no CORS).
    for variable in ("PAGEDSERVE_MAX_MODEL_LEN", "PAGEDSERVE_TOOL_CALL_PARSER", "PAGEDSERVE_ENABLE_PREFIX_CACHING",
                     "PAGEDSERVE_SERVED_MODEL_NAME", "PAGEDSERVE_ALLOWED_ORIGINS"):
        monkeypatch.setenv(variable, "")
    args = build_parser().parse_args([])
    assert (args.max_model_len, args.tool_call_parser, args.enable_prefix_caching, args.served_model_name,
            args.allowed_origins) == (None, None, True, None, "")


def test_the_command_line_gives_one_line_and_exit_code_1(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--model", str(tmp_path / "nope")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (1, "") and done.stderr.count("\n") == 1, done
    assert "does not exist" in done.stderr
    done = subprocess.run([sys.executable, "-m", "pagedserve", "generate", "--model", str(tmp_path / "nope")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (1, "") and done.stderr.count("\n") == 1, done


def test_generate_says_each_phase_on_stderr(llama_dir):
    done = subprocess.run([sys.executable, "-m", "pagedserve", "generate", "--model", str(llama_dir), "--max-tokens",
                           "2", "--kv-cache-memory-bytes", str(8 << 20), "one", "two"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    phases = [line for line in done.stderr.splitlines() if line.startswith("pagedserve: ")]
    assert [line.split()[1] for line in phases] == ["importing", "loading", "loaded", "generated"], phases
    assert [json.loads(line)["prompt"] for line in done.stdout.splitlines()] == ["one", "two"]
