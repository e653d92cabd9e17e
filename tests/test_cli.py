"""The `hotweights` command line, run in this process against real vLLM engines."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hotweights.cli.main import main
from hotweights.errors import ConfigError, install
from hotweights.protocol import tokens
from hotweights.server import serve


def test_help_explains_every_command():
    out = subprocess.run([sys.executable, "-m", "hotweights.cli.main", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert all(c in out for c in ("serve", "status", "layout", "demo", "sync", "diagnose"))
    out = subprocess.run([sys.executable, "-m", "hotweights.cli.main", "--version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("hotweights ")


def test_every_command_s_help_ends_with_examples_that_parse(capsys):
    import shlex

    from hotweights.cli.main import _EXAMPLES, _parser

    parser = _parser()
    for name, lines in _EXAMPLES.items():
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--help"])
        assert capsys.readouterr().out.rstrip().endswith(lines[-1])
        for line in lines:
            words = shlex.split(line, comments=True)
            assert words[0] == "hotweights"
            args, extra = parser.parse_known_args(words[1:])  # a usage error exits
            assert args.command == name and (not extra or name == "serve"), line


@pytest.mark.parametrize("argv", [
    ["demo", "--steps", "0"],
    ["demo", "--steps", "x"],
    ["demo", "--rl", "--checkpoint-every", "-1"],
    ["demo", "--arch", "gpt2"],
    ["demo", "--workdir", ""],
])
def test_demo_refuses_bad_values_before_building_anything(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "hotweights demo: error: argument" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["demo", "--workdir", "FILE"], "argument --workdir: FILE is not a directory"),
    (["demo", "--rl", "--arch", "qwen2"], "--arch qwen2 with --rl: the RL demo trains"),
    (["diagnose", "DIR", "--cafile", "ca.pem"], "--token, --token-file and --cafile go with "
                                                "--server"),
    (["sync", "DIR", "--from", "DIR", "--token", "t" * 32], "go with --server"),
    (["serve", "DIR", "--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go "
                                                 "together"),
])
def test_usage_mistakes_are_named_with_the_command_s_usage_and_exit_2(argv, message,
                                                                      tmp_path, capsys):
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / w) if w in ("FILE", "DIR") else w for w in argv]
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and f"hotweights {argv[0]}: error: " in err
    assert message.replace("FILE", str(tmp_path / "FILE")) in err and not out


def test_a_usage_error_under_json_is_json_on_stdout_too(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # a script reading stdout gets JSON whatever failed
        main(["status", "--json", "--token-file", str(tmp_path / "missing"),
              "http://127.0.0.1:1"])
    out = json.loads(capsys.readouterr().out)
    assert e.value.code == 2 and out["error"].startswith("hotweights status: argument "
                                                         "--token-file: ")


# as a user's: the tests' VLLM_LOGGING_LEVEL (conftest) is the user's choice, which layout keeps
_UNSET_VLLM_LOG = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}


@pytest.mark.vllm
def test_layout_prints_the_map(tiny_model, tmp_path):
    # a checkpoint without a tokenizer and of a context shorter than layout's 256 (layout
    # generates nothing); in a process of its own: vLLM's MoE engine run in this one left
    # it slow for what ran after (the demos' servers ~2.5x slower here, env and memory
    # policy put back)
    model_dir = Path(shutil.copytree(tiny_model("qwen3_moe"), tmp_path / "m", ignore=(
        shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config,
                                                       "max_position_embeddings": 128}))
    done = subprocess.run([sys.executable, "-m", "hotweights.cli.main", "layout",
                           str(model_dir)], capture_output=True, text=True,
                          check=True, timeout=200, env=_UNSET_VLLM_LOG)
    # vLLM's start-up log, warnings and loading bar: only with -v
    assert not re.search(r"^[A-Z]+ vllm\.|Warning: |Loading", done.stderr, re.M), done.stderr
    out = done.stdout
    assert "model.layers.1.mlp.experts.routed_experts.w13_weight" in out
    assert "model.layers.1.mlp.experts.gate_up_proj" in out
    assert "model.layers.0.self_attn.k_proj.weight" in out
    assert "0:300 (0)" in out  # the HF vocab rows of the padded embedding
    assert "0 vLLM unmapped, 0 HF missing" in out
    assert "25 HF parameters mapped (" in out  # each once, not each of its pieces
    assert "values: 25 HF parameters hold what the checkpoint holds" in " ".join(out.split())


@pytest.mark.vllm
def test_layout_of_a_checkpoint_vllm_cannot_load_is_one_clear_line(tiny_model, tmp_path):
    model_dir = Path(shutil.copytree(tiny_model("llama"), tmp_path / "m"))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(
        {**config, "intermediate_size": 2 * config["intermediate_size"]}))  # not the weights'
    done = subprocess.run([sys.executable, "-m", "hotweights.cli.main", "layout",
                           str(model_dir)], capture_output=True, text=True, timeout=200,
                          env=_UNSET_VLLM_LOG)
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith(f"error: {model_dir}: vLLM cannot load it (")
    assert done.stderr.endswith("); --verbose shows vLLM's log\n")
    assert len(done.stderr.splitlines()) == 1, done.stderr  # nor its loading bar's last line


@pytest.mark.parametrize("flag", [[], ["--model-dir"]])  # as sync, diagnose, recover
def test_layout_of_a_missing_directory_is_one_clear_line(tmp_path, capsys, flag):
    assert main(["layout", *flag, str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope" in err


@pytest.mark.parametrize(("flags", "named"), [
    (["--api-server-count", "2"], "--api-server-count 2"),
    (["-asc=3"], "--api-server-count 3"),
    (["--data-parallel-size", "2"], "--data-parallel-size 2"),
    (["--data_parallel_size", "2"], "--data-parallel-size 2"),  # vLLM reads both spellings
    (["--api_server_count=2"], "--api-server-count 2"),
])
def test_serve_refuses_flags_that_split_the_weights_or_the_updates(flags, named, tmp_path,
                                                                   capsys):
    token = tmp_path / "token"
    assert main(["serve", str(tmp_path), "--token-file", str(token), *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err
    assert not token.exists()  # refused before anything was written or started


def test_serve_refuses_a_token_file_others_could_replace(tmp_path, capsys):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # (the umask)
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", str(tmp_path), "--token-file", str(shared / "t")]) == 1
    assert (f"error: --token-file {shared / 't'}: {shared} is writable by every user (mode "
            "777): they could replace the token file") in capsys.readouterr().err
    shared.chmod(0o1777)  # sticky, as /tmp: another user could still take the name first
    with pytest.raises(ConfigError, match="writable by every user \\(mode 1777\\)"):
        serve.check_token_file(shared / "t")
    shared.chmod(0o775)  # a group's (a umask of 002): as meant
    serve.check_token_file(shared / "t")


def test_serve_s_token_directory_is_its_user_s_under_any_umask(tmp_path):
    old = os.umask(0)
    try:
        serve.check_token_file(tmp_path / "new" / "t")
        tokens.write_token(tmp_path / "other" / "t", "secret")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "other").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "other" / "t").stat().st_mode) == 0o600
    assert os.listdir(tmp_path / "other") == ["t"]


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file of another user's (root only)")
def test_serve_refuses_a_token_file_of_another_users(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    theirs = tmp_path / "t"
    theirs.write_text("their token\n")
    os.chown(theirs, 65534, 65534)
    assert main(["serve", str(tmp_path), "--token-file", str(theirs)]) == 1
    assert (f"error: --token-file {theirs}: owned by another user (uid 65534); give a path of "
            "your own") in capsys.readouterr().err
    assert theirs.read_text() == "their token\n"


@pytest.mark.parametrize(("value", "said"), [
    ("1", "vLLM then adds its development routes (/collective_rpc"),
    (" 2", "vLLM then adds its development routes (/collective_rpc"),
    ("true", "not an integer (vLLM would fail on it)"),
])
def test_serve_refuses_vllms_dev_mode_whose_routes_no_token_guards(value, said, tmp_path,
                                                                   capsys, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", value)
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", str(tmp_path), "--token-file", str(tmp_path / "t")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: VLLM_SERVER_DEV_MODE={value}: {said}") and "unset it" in err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("value", ["0", "00", "-0"])
def test_serve_takes_vllms_dev_mode_off_as_vllm_reads_it(value):
    serve.refuse_dev_mode({"VLLM_SERVER_DEV_MODE": value})


@pytest.mark.parametrize(("argv", "named"), [
    (["--model", "other"], "--model: give the model as MODEL"),
    (["--worker-extension-cls=x.Y"], "--worker-extension-cls: hotweights serve sets"),
    (["--uds", "/tmp/s"], "--uds: hotweights serve answers on --host and --port"),
    (["--host", "10.255.255.1"], "--host 10.255.255.1: cannot listen on"),
    (["--token-file", "{tmp}"], "--token-file {tmp}: a directory"),
    (["--token-file", "/proc/nope/x.token"], "--token-file /proc/nope/x.token: cannot write"),
])
def test_serve_refuses_what_it_cannot_serve_by_name_before_vllm_starts(argv, named,
                                                                        tmp_path, capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    (tmp_path / "config.json").write_text("{}")
    token = [] if "--token-file" in argv else ["--token-file", str(tmp_path / "t")]
    assert main(["serve", str(tmp_path), *token, *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named.format(tmp=tmp_path) in err
    assert not (tmp_path / "t").exists()


def test_serve_refuses_a_model_path_that_is_no_directory_and_a_bad_port(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope"), "--token-file", str(tmp_path / "t")]) == 1
    assert f"error: MODEL {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert main(["serve", str(tmp_path / "afile"), "--token-file", str(tmp_path / "t")]) == 1
    assert f"error: MODEL {tmp_path / 'afile'}: not a directory" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--token-file", str(tmp_path / "t")]) == 1
    assert f"error: MODEL {tmp_path}: no config.json in it" in capsys.readouterr().err
    assert main(["serve", "~no-such-user-hw/m", "--token-file", str(tmp_path / "t")]) == 1
    assert ("error: MODEL ~no-such-user-hw/m: no such directory (no home directory for "
            "~no-such-user-hw)") in capsys.readouterr().err
    for port in ("0", "70000"):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(tmp_path), "--port", port])
        assert e.value.code == 2 and "--port" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--dtype", "float32", "MODEL"],
                                  ["--enforce-eager", "MODEL", "--dtype", "float32"]])
def test_serve_wants_vllm_s_flags_after_the_model(argv, tmp_path, capsys):
    # argparse took the flag's value for the model: vLLM then got "--dtype ./model"
    with pytest.raises(SystemExit) as e:
        main(["serve", *[str(tmp_path) if w == "MODEL" else w for w in argv]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "vLLM's flags go after MODEL" in err and argv[0] in err

    from hotweights.cli.main import _before_model  # a flag=value took no word: fine

    assert _before_model(["serve", "--max-model-len=2048", "./m", "--served-model-name",
                          "./m"], "./m", ["--max-model-len=2048", "--served-model-name",
                                          "./m"]) is None


@pytest.mark.parametrize(("argv", "what"), [
    (["serve", "{tmp}", "--token-file", "{tmp}/t"], "hotweights serve"),
    (["demo"], "hotweights demo"), (["demo", "--rl"], "hotweights demo --rl")])
def test_what_runs_vllm_says_how_to_install_it_where_it_is_missing(argv, what, tmp_path,
                                                                   capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    assert main([a.format(tmp=tmp_path) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {what} runs vLLM, which is not installed")
    assert f"{install('cpu')} (vLLM's CPU build" in err and not (tmp_path / "t").exists()


def test_serve_passes_other_data_parallel_flags_to_vllm():
    from hotweights.server.serve import refuse_unshareable

    refuse_unshareable(["-dpl", "4", "-dpb=ray", "--data-parallel-size-local", "2", "-dp",
                        "1", "--api-server-count=1"])  # none of them splits anything


@pytest.mark.vllm
@pytest.mark.timeout(480)  # builds a model, starts a server, trains 30 steps: ~100 s here
def test_demo_trains_the_served_weights_in_place(tmp_path, capsys):
    assert main(["demo", "--workdir", str(tmp_path), "--steps", "30"]) == 0
    out = capsys.readouterr().out
    assert " 0 of " in out and "weight bytes copied" in out
    before = out.split("before  (version 0):")[1].splitlines()[0]
    after = out.split("after   (version 30):")[1].splitlines()[0]
    assert before != after and "the trainer" in after
    assert " 0 errors" in out
    line = out.split("checkpoint: ")[1].splitlines()[0]
    assert line.startswith("version 30@") and " 0 of " not in line
    trained, served = tmp_path / "checkpoint", tmp_path / "llama"
    assert (trained / "model.safetensors").read_bytes() != (served / "model.safetensors"
                                                            ).read_bytes()
    assert f"kept in {tmp_path}: the model" in " ".join(out.split())  # rich wraps lines


@pytest.mark.parametrize("rl", [[], ["--rl"]])
def test_demo_never_writes_over_a_directory_it_did_not_make(rl, tmp_path, capsys):
    (tmp_path / "checkpoint").mkdir()  # the user's: the demo would replace it
    (tmp_path / "checkpoint" / "notes.txt").write_text("mine")
    assert main(["demo", *rl, "--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"error: --workdir {tmp_path}: not empty, and no demo's" in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["checkpoint", "notes.txt"]
    (tmp_path / "afile").write_text("")
    assert main(["demo", *rl, "--workdir", str(tmp_path / "afile" / "sub")]) == 1
    err = capsys.readouterr().err
    assert f"error: --workdir {tmp_path / 'afile' / 'sub'}: cannot write there: " in err, err


def test_a_demo_s_directory_is_reused_and_an_empty_one_taken(tmp_path):
    from hotweights.cli.demo import MARK, workdir_for
    from hotweights.errors import ConfigError

    assert workdir_for(str(tmp_path / "new"), "x") == tmp_path / "new"
    (tmp_path / "new" / "llama").mkdir()  # what the demo built there
    assert workdir_for(str(tmp_path / "new"), "x") == tmp_path / "new"  # an earlier demo's
    (tmp_path / "new" / "notes.txt").write_text("mine")  # put there since: not replaced
    with pytest.raises(ConfigError, match="not empty, and no demo's"):
        workdir_for(str(tmp_path / "new"), "x")
    made = workdir_for(None, "hotweights-test-")
    assert (made / MARK).exists()
    shutil.rmtree(made)


def test_demo_checkpoint_every_without_rl_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--checkpoint-every", "3"])
    assert e.value.code == 2
    assert "hotweights demo: error: --checkpoint-every goes with --rl" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.timeout(480)  # builds a model, starts a server, 20 GRPO steps: ~90 s here
def test_demo_rl_teaches_the_served_model_with_grpo(tmp_path, capsys):
    assert main(["demo", "--rl", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = out.split("GRPO: 20 steps in ")[1].splitlines()[0]
    first, last = summary.split("reward ")[1].split(" (best")[0].split(" -> ")
    assert float(first) <= 0.1 and float(last) >= 0.6, summary
    assert "0 weight bytes copied" in summary and "version 20@" in summary
    assert summary.endswith(" 0 errors") and "versions 0..20" in summary
    assert "step 5: checkpoint" in out and "step 20: checkpoint" in out
    reloaded = out.split("reloaded in plain transformers")[1].splitlines()[0]
    # trained (the untrained model's is ~0); greedy, on other kernels than vLLM's: a
    # token may differ from the served model's (CI once saw 0.50 where the server had 0.6+)
    assert float(reloaded.split("reward ")[1]) >= 0.5, reloaded


@pytest.mark.parametrize("argv", [["sync", "d", "--from", "a", "--from", "b"],
                                  ["sync", "d", "--server", "http://a", "--server", "http://b"],
                                  ["sync", "d", "--from", "a", "--version", "1", "--version", "2"],
                                  ["diagnose", "d", "--from", "a", "--from", "b"]])
def test_an_option_given_twice_is_refused_not_the_last_taken(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    option = argv[-2]
    assert f"error: argument {option}: given twice ({argv[-3]} and {argv[-1]}); give it once" \
        in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "m", "--token", ""],
                                  ["status", "--token", " "],
                                  ["sync", "d", "--server", "http://a", "--token", ""],
                                  ["sync", "d", "--from", "a", "--weight-version", ""]])
def test_an_empty_value_is_refused_not_taken_as_none(argv, capsys):
    # an unset "$TOKEN" would mean another token (serve: a random one), or no version
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"error: argument {argv[-2]}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "-v", "MODEL"], ["serve", "MODEL", "-v"]])
def test_serve_takes_verbose_before_or_after_model_as_every_command(argv, tmp_path, capsys):
    argv = [str(tmp_path / "nope") if w == "MODEL" else w for w in argv]
    assert main([*argv, "--token-file", str(tmp_path / "t")]) == 1  # not a usage error
    assert f"error: MODEL {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err


def test_every_port_up_to_65535_is_taken():
    from hotweights.cli.main import _parser

    for port in ("1", "65535"):
        args, _ = _parser().parse_known_args(["serve", "m", "--port", port])
        assert args.port == int(port)


def test_demo_takes_the_least_values_its_help_allows():
    from hotweights.cli.main import _parser

    args = _parser().parse_args(["demo", "--steps", "1"])
    assert args.steps == 1
    args = _parser().parse_args(["demo", "--rl", "--checkpoint-every", "0"])  # at the end only
    assert args.checkpoint_every == 0


def test_demo_defaults_are_those_its_help_gives(monkeypatch):
    import types

    ran = []
    for name in ("hotweights.cli.demo", "hotweights.cli.demo_rl"):  # (no model built)
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(
            run=lambda args: ran.append(args) or 0))
    assert main(["demo"]) == 0 and main(["demo", "--rl"]) == 0
    plain, rl = ran
    assert plain.steps == 30 and plain.checkpoint_every is None
    assert (rl.steps, rl.checkpoint_every) == (20, 5)


@pytest.mark.parametrize("arch", ["qwen3", "llama_tied"])
def test_demo_rl_refuses_any_arch_but_llama(arch, capsys, monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "hotweights.cli.demo_rl", types.SimpleNamespace(
        run=lambda args: 0))  # were it taken: no demo run here
    with pytest.raises(SystemExit) as e:
        main(["demo", "--rl", "--arch", arch])
    assert e.value.code == 2
    assert f"--arch {arch} with --rl: the RL demo trains a tiny llama" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["HTTP://127.0.0.1:1", " http://127.0.0.1:1"])
def test_a_cafile_for_a_plain_http_server_is_refused_however_the_url_is_spelled(url, capsys):
    with pytest.raises(SystemExit) as e:
        main(["status", url, "--cafile", "ca.pem"])
    assert e.value.code == 2
    assert "--cafile is for an https server" in capsys.readouterr().err


def test_ctrl_c_with_nothing_to_say_is_the_word_interrupted_and_exit_130(monkeypatch, capsys):
    from hotweights.cli import status

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(status, "server_status", ctrl_c)
    assert main(["status", "--token", "t"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize(("argv", "level"), [(["-v", "recover"], "INFO"),
                                             (["recover", "-v"], "INFO"),
                                             (["recover"], "WARNING")])
def test_verbose_logs_the_library_s_info_lines(argv, level, tmp_path, monkeypatch, capsys):
    import logging

    # (pytest's own log handlers would make the real basicConfig a no-op here)
    configured = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: configured.append(kwargs))
    assert main([*argv, str(tmp_path)]) == 0
    assert [c["level"] for c in configured] == [getattr(logging, level)]


def test_layout_of_a_directory_without_config_json_names_what_is_missing(tmp_path, capsys):
    assert main(["layout", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path}: not a model directory (no "
                                       "config.json)\n")


def test_layout_s_quiet_drops_stderr_shows_hotweights_log_and_puts_all_back(capfd):
    import logging
    import warnings

    from hotweights.cli.layout import _quiet

    stderr, log = sys.stderr, logging.getLogger("hotweights")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError), _quiet(True):  # vLLM's start failing, say
            os.write(2, b"vllm's C++ warning\n")
            print("vllm's log line", file=sys.stderr)
            warnings.warn("vllm's python warning", stacklevel=1)
            logging.getLogger("hotweights.layout").warning("hotweights' own line")
            raise RuntimeError
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "vllm" not in err and not seen
    assert "hotweights' own line" in err and err.endswith("after\n")
    assert sys.stderr is stderr and log.propagate and not log.handlers


def test_layout_s_quiet_off_lets_everything_through(capfd):
    from hotweights.cli.layout import _quiet

    with _quiet(False):
        os.write(2, b"vllm's C++ warning\n")
    assert capfd.readouterr().err == "vllm's C++ warning\n"


def test_serve_with_remote_refuses_a_weight_transfer_config_of_its_own():
    from hotweights.cli.main import _parser

    args, extra = _parser().parse_known_args(
        ["serve", "m", "--remote", "--weight-transfer-config", '{"backend": "nccl"}'])
    with pytest.raises(ConfigError, match="--remote selects the hotweights weight-transfer "
                       "engine; drop --weight-transfer-config"):
        serve.command(args, extra)
    args, extra = _parser().parse_known_args(["serve", "m", "--remote"])
    assert "--weight-transfer-config" in serve.command(args, extra)


@pytest.mark.parametrize("flags", [["-dp", "2"], ["-dp", "1", "--data-parallel-size", "2"]])
def test_serve_refuses_the_short_and_the_last_data_parallel_flag(flags):
    # vLLM keeps the last value given
    from hotweights.errors import ServerError

    with pytest.raises(ServerError, match="--data-parallel-size 2: each data-parallel rank"):
        serve.refuse_unshareable(flags)


def test_a_flag_s_value_is_the_last_given_in_any_spelling_or_none():
    assert serve._flag(["--max-model-len", "8", "--max_model_len=16"], "--max-model-len") == "16"
    assert serve._flag(["--dtype", "half"], "--max-model-len") is None
    assert serve._flag(["--dtype"], "--dtype") is None  # no value after it


def test_serve_refuses_its_own_flags_even_given_empty():
    with pytest.raises(ConfigError, match="--model: give the model as MODEL"):
        serve.refuse_ours(["--model="])


def test_a_mistral_model_directory_needs_its_params_json(tmp_path):
    mistral = ["--config-format", "mistral"]
    with pytest.raises(ConfigError, match="no config.json in it \\(nor Mistral's params.json\\)"):
        serve.check_model(str(tmp_path), mistral)
    (tmp_path / "params.json").write_text("{}")
    assert serve.check_model(str(tmp_path), mistral) == str(tmp_path)
    assert serve.check_model(str(tmp_path)) == str(tmp_path)


def test_the_token_file_check_leaves_nothing_behind(tmp_path):
    serve.check_token_file(tmp_path / "d" / "t")
    assert os.listdir(tmp_path / "d") == []


def test_serve_names_the_busy_port_as_the_fault(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--port {port}: cannot listen on 127.0.0.1:"
                           f"{port} .*is another server running there"):
            serve._refuse_busy_port("127.0.0.1", port)


def test_a_port_a_stopped_server_left_in_time_wait_is_free_to_serve_on():
    # uvicorn binds with SO_REUSEADDR, and so does the check: a restart right after a stop
    # takes the port
    import socket

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its port in TIME_WAIT
            client.recv(1)
    serve._refuse_busy_port("127.0.0.1", port)


def test_serve_waits_for_its_own_server_id_in_the_version_header(monkeypatch):
    import http.server
    import threading

    from hotweights.protocol.version import VERSION_HEADER

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header(VERSION_HEADER, "7@abc123")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    class Running:  # a child that runs for a few probes, then exits
        polls = 0

        def poll(self):
            self.polls += 1
            return None if self.polls < 4 else 0

    monkeypatch.setattr(serve.time, "sleep", lambda s: None)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert serve._wait_answering(Running(), url, "abc123", None) is True
        assert serve._wait_answering(Running(), url, "other", None) is False  # not ours
    finally:
        server.shutdown()
        server.server_close()


def test_serve_says_it_discarded_an_uncommitted_sync_before_vllm_reads(tmp_path, capsys):
    from hotweights.checkpoint import journal

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / journal._TMP_NAME).write_bytes(b"half a journal")
    assert serve.recovered(str(tmp_path), None) == str(tmp_path)
    assert f"{tmp_path}: discarded an interrupted checkpoint sync" in capsys.readouterr().out
    assert not (tmp_path / journal._TMP_NAME).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a directory and a file root owns")
def test_a_token_file_in_root_s_directory_is_taken_but_not_one_root_owns(tmp_path,
                                                                       monkeypatch):
    # root is trusted with the directory; a file of root's is not the user's to replace
    monkeypatch.setattr(serve.os, "geteuid", lambda: 12345)  # as a user, in root's tmp_path
    serve.check_token_file(tmp_path / "t")
    (tmp_path / "theirs").write_text("root's token\n")
    with pytest.raises(ConfigError, match="owned by another user \\(uid 0\\)"):
        serve.check_token_file(tmp_path / "theirs")


def test_serve_on_every_interface_given_as_an_empty_host_checks_that_port():
    # "" is every interface to vLLM, as 0.0.0.0: not a host name to look up
    import socket

    serve._refuse_busy_port("", 0)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--port {port}: cannot listen on 0.0.0.0:{port} "):
            serve._refuse_busy_port("", port)
