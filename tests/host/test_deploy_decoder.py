"""A decoder artifact (``opsdk build <decoder> --weights ...``): the library holds no weights,
``weights.bin`` holds each kernel-form tensor once, the loaded decoder matches the in-process
compile bit for bit, ``opsdk run`` checks it, and misuse gets a clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from opsdk.cli import main as cli
from opsdk.deploy import (
    ArtifactError,
    build_decoder_artifact,
    load_artifact,
    load_decoder,
    run_artifact,
)
from opsdk.llm import Decoder, DecoderConfig, compile_decoder, random_weights

CFG = DecoderConfig(vocab=64, width=64, layers=2, heads=2, positions=32)


@pytest.fixture(scope="module")
def weights():
    return random_weights(CFG, seed=3)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, weights):
    out = tmp_path_factory.mktemp("dec") / "int4"
    m = build_decoder_artifact(weights, out, weights="int4", activations="q8_0",
                               target="x86", log=None)
    return out, m


def test_library_holds_no_weights_and_the_file_each_tensor_once(artifact):
    out, m = artifact
    w = m["weights"]
    tensors = w["tensors"]
    assert m["kind"] == "decoder" and w["layout"] == "raw"
    assert all(t["offset"] % w["align"] == 0 for t in tensors)
    assert w["loaded_bytes"] == sum(t["bytes"] for t in tensors)
    # The entries take the same tensors: prefill and decode pack each weight alike, and
    # check (which calls both) takes their union.
    uses = w["uses"]
    assert uses["prefill"] == uses["decode"] == uses["check"]
    assert len(set(uses["prefill"])) == len(tensors)
    # No tensor twice (equal bytes are one tensor).
    arrays = [np.fromfile(out / w["file"], np.uint8, t["bytes"], offset=t["offset"]).tobytes()
              for t in tensors]
    assert len(set(arrays)) == len(arrays)
    # The library is code: the largest weight's bytes are not in it.
    big = max(range(len(tensors)), key=lambda i: tensors[i]["bytes"])
    assert tensors[big]["bytes"] >= 1024
    assert arrays[big] not in (out / "model.so").read_bytes()
    # both float64 references are recorded (q8_0 inputs: reported, not judged)
    assert {"host_vs_reference", "host_vs_float_model"} <= set(m["decoder"]["check"])


def test_loaded_decoder_matches_the_in_process_compile(artifact, weights):
    out, _ = artifact
    dec = load_decoder(out)
    ref = Decoder(compile_decoder(weights, weights_mode="int4", activations="q8_0",
                                  cache=False), CFG)
    prompt = [3, 1, 4, 1, 5]
    assert np.array_equal(dec.forward(prompt), ref.forward(prompt))
    for t in (9, 2, 6):
        assert np.array_equal(dec.forward([t]), ref.forward([t]))
    assert dec.generate(prompt, 5)[0] == ref.generate(prompt, 5)[0]


def test_opsdk_run_checks_the_stored_prompt(artifact, capsys):
    out, _ = artifact
    res = run_artifact(out, repeats=2, log=None)
    assert res["ok"] and res["outputs"][0]["vs_host"]["bitexact"]
    with pytest.raises(ArtifactError, match=r"decoder.*stored prompt"):
        run_artifact(out, random_inputs=True, log=None)
    with pytest.raises(ArtifactError, match="load_decoder"):
        load_artifact(out)


def test_damaged_weights_are_refused(artifact, tmp_path):
    import shutil

    out, _ = artifact
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    path = bad / "weights.bin"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match its manifest"):
        load_decoder(bad)


def test_cli_build_of_a_named_decoder_and_its_usage_errors(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert cli(["build", "gpt2-tiny", "--weights", "int8", "--target", "x86", "-o", str(out),
                "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["decoder"]["weights"] == "int8" and m["decoder"]["config"]["vocab"] == 1000
    # model-file options on a decoder, decoder options on a model file: named, exit 2
    assert cli(["build", "gpt2-tiny", "--int8", "-o", str(tmp_path / "x")]) == 2
    assert "--int8 is for model files" in capsys.readouterr().err
    assert cli(["build", "gpt2-tiny", "--activations", "q8_0", "-o", str(tmp_path / "x")]) == 2
    assert "needs --weights int8 or int4" in capsys.readouterr().err
    assert cli(["build", "no-such-model", "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "decoder name" in err
    assert not (tmp_path / "x").exists()


def test_cpp_example_runs_the_decoder_check_bit_for_bit(artifact, tmp_path):
    # The C++ host program (no Python, no JSON): io.txt names the check entry and where each
    # weight lies in weights.bin; its logits of every step equal the host build's.
    import pathlib
    import subprocess
    import sys

    out, m = artifact
    exe = tmp_path / "deploy_run"
    deploy = pathlib.Path(__file__).resolve().parents[2] / "examples" / "deploy"
    subprocess.run(["make", "-s", "-C", str(deploy), f"TARGET={exe}",
                    f"PYTHON={sys.executable}"], check=True)
    got_dir = tmp_path / "got"
    got_dir.mkdir()
    proc = subprocess.run([str(exe), str(out), str(out / "check" / "inputs"), str(got_dir)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    shape = m["outputs"][0]["example_shape"]
    got = np.fromfile(got_dir / f"{m['outputs'][0]['name']}.bin", "float32").reshape(shape)
    with np.load(out / "check" / "expected.npz") as z:
        assert np.array_equal(got, z["host_0"])
    lines = (out / "io.txt").read_text().splitlines()
    assert "entry check" in lines and f"config vocab {CFG.vocab}" in lines
    assert "config positions 32" in lines
    assert sum(ln.startswith("rawweight ") for ln in lines) == len(m["weights"]["tensors"])
    assert f"uses decode {' '.join(map(str, m['weights']['uses']['decode']))}" in lines
    # greedy generation in C++ (create_cache, prefill, decode, argmax): Python's tokens
    dec = load_decoder(out)
    for prompt, n in (([1, 2, 3], 8), (list(range(10, 30)), 5)):
        dec.reset()
        want, _ = dec.generate(prompt, n)
        proc = subprocess.run([str(exe), str(out), "--generate", ",".join(map(str, prompt)),
                               str(n)], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == ",".join(map(str, want))
    assert len(set(want)) > 1  # the tokens change: the loop feeds each one back
    proc = subprocess.run([str(exe), str(out), "--generate", "1,99", "4"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "'99' is not a token id in [0, 64)" in proc.stderr
    # a weights file cut short: an error naming it, not garbage
    cut = tmp_path / "cut"
    import shutil

    shutil.copytree(out, cut)
    with open(cut / "weights.bin", "r+b") as f:
        f.truncate(m["weights"]["bytes"] // 2)
    proc = subprocess.run([str(exe), str(cut), str(cut / "check" / "inputs"), str(got_dir)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "weights.bin is shorter than io.txt says" in proc.stderr
