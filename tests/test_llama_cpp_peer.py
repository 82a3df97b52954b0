"""The llama.cpp peer script (scripts/llama_cpp_peer.py): its arguments, the table's medians and ratios from made-up
runs, the first divergence of two token lists, the message when the optional binding is missing, and the rewrite that
lets the binding's libraries load on a glibc older than 2.38 (on a small ELF file built here). One test runs llama.cpp
itself; it is skipped, saying why, where the binding is not installed or the peer's GGUF file is not in the cache."""

from __future__ import annotations

import struct
import sys

import pytest

from scripts import llama_cpp_peer as peer


def test_arguments_default_to_the_benchmark_inputs_and_refuse_nonsense():
    args = peer.parse_args([])
    assert (args.lengths, args.docs, args.rounds, args.threads, args.max_new_tokens, args.numerics, args.out) == (
        [7168, 1024], 3, 3, 2, 128, "auto", None)
    assert peer.parse_args(["--lengths", "256", "--rounds", "1", "--numerics", "fp32"]).lengths == [256]
    for bad in (["--rounds", "0"], ["--threads", "0"], ["--max-new-tokens", "1"], ["--numerics", "fp16"]):
        with pytest.raises(SystemExit):
            peer.parse_args(bad)


def run(length, document, round_, method, speed):
    return {"length": length, "document": document, "round": round_, "method": method, "decode_tokens_per_s": speed}


def test_table_gives_medians_and_paired_ratios_to_llama_cpp():
    records = [
        run(7168, "a", 1, peer.PEER, 30.0), run(7168, "a", 1, "target alone", 15.0), run(7168, "a", 1, "spec", 60.0),
        run(7168, "b", 1, peer.PEER, 20.0), run(7168, "b", 1, "target alone", 12.0), run(7168, "b", 1, "spec", 20.0),
        run(7168, "a", 2, peer.PEER, 10.0), run(7168, "a", 2, "target alone", 9.0), run(7168, "a", 2, "spec", 40.0),
        run(1024, "a", 1, "target alone", 50.0),  # no llama.cpp run to pair with
    ]
    rows = {(r["length"], r["method"]): r for r in peer.table(records)}
    assert [k for k in rows] == [(7168, peer.PEER), (7168, "target alone"), (7168, "spec"), (1024, "target alone")]
    assert rows[(7168, peer.PEER)]["decode_tokens_per_s"] == 20.0 and rows[(7168, peer.PEER)]["ratio_to_peer"] == 1.0
    # ratios per pair 0.5, 0.6, 0.9: their median, not the ratio of the medians (12 / 20)
    assert rows[(7168, "target alone")]["decode_tokens_per_s"] == 12.0
    assert rows[(7168, "target alone")]["ratio_to_peer"] == pytest.approx(0.6)
    assert rows[(7168, "spec")]["ratio_to_peer"] == pytest.approx(2.0)  # 2.0, 1.0, 4.0
    assert rows[(7168, "spec")]["runs"] == 3
    assert rows[(1024, "target alone")]["ratio_to_peer"] is None
    text = peer.format_table(peer.table(records))
    assert "2.00x" in text and "0.60x" in text and text.count("\n") == 4


def test_first_divergence():
    assert peer.first_divergence([1, 2, 3], (1, 2, 3)) is None
    assert peer.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert peer.first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early
    assert peer.agreement(peer.PEER, 4) == "differs from the target alone at token 4"
    assert peer.agreement("target alone", None) == "the reference tokens"


def test_a_missing_binding_says_how_to_install_it_before_loading_anything(monkeypatch):
    monkeypatch.setitem(sys.modules, peer.BINDING, None)  # import fails as if it were not installed
    with pytest.raises(SystemExit) as stopped:
        peer.main(["--lengths", "256"])
    assert peer.INSTALL in str(stopped.value) and "llama-cpp-py-sync==" in peer.INSTALL


def small_elf() -> tuple[bytearray, dict]:
    """An ELF64 file with only the sections old_glibc_copy reads: .dynsym (null, __isoc23_strtol, memcpy), .dynstr,
    .gnu.version and .gnu.version_r (libc.so.6 needing GLIBC_2.2.5 as version 2 and GLIBC_2.38 as version 3)."""
    names = b"\0__isoc23_strtol\0memcpy\0libc.so.6\0GLIBC_2.2.5\0GLIBC_2.38\0"
    at = {n: names.index(n.encode() + b"\0") for n in ("__isoc23_strtol", "memcpy", "libc.so.6", "GLIBC_2.2.5",
                                                         "GLIBC_2.38")}
    symbols = bytes(24) + b"".join(struct.pack("<IBBHQQ", at[n], 0x12, 0, 0, 0, 0) for n in ("__isoc23_strtol", "memcpy"))
    versions = struct.pack("<HHH", 0, 3, 2)
    needs = (struct.pack("<HHIII", 1, 2, at["libc.so.6"], 16, 0)
             + struct.pack("<IHHII", 0, 0, 2, at["GLIBC_2.2.5"], 16) + struct.pack("<IHHII", 0, 0, 3, at["GLIBC_2.38"], 0))
    body, offsets = bytearray(64), {}
    for key, blob in (("dynsym", symbols), ("dynstr", names), ("versym", versions), ("verneed", needs)):
        offsets[key] = len(body)
        body += blob + bytes(-len(blob) % 8)
    shoff = len(body)
    headers = [(0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
               (0, 11, 0, 0, offsets["dynsym"], len(symbols), 2, 1, 8, 24),
               (0, 3, 0, 0, offsets["dynstr"], len(names), 0, 0, 1, 0),
               (0, 0x6FFFFFFF, 0, 0, offsets["versym"], len(versions), 1, 0, 2, 2),
               (0, 0x6FFFFFFE, 0, 0, offsets["verneed"], len(needs), 2, 1, 8, 0)]
    body += b"".join(struct.pack("<IIQQQQIIQQ", *h) for h in headers)
    body[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", body, 0x28, shoff)
    struct.pack_into("<HH", body, 0x3A, 64, len(headers))
    return body, {"at": at, **offsets}


def test_the_c23_entry_points_become_the_older_ones_and_glibc_2_38_is_only_wished_for():
    data, where = small_elf()
    assert peer.old_glibc_copy(data) == 1
    names = where["dynstr"]
    assert data[names + where["at"]["__isoc23_strtol"]:].split(b"\0")[0] == b"strtol"
    assert data[names + where["at"]["memcpy"]:].split(b"\0")[0] == b"memcpy"
    assert struct.unpack_from("<HHH", data, where["versym"]) == (0, 1, 2)  # strtol unversioned, memcpy untouched
    flags = [struct.unpack_from("<H", data, where["verneed"] + 16 + 16 * i + 4)[0] for i in range(2)]
    assert flags == [0, peer.VER_FLG_WEAK]  # GLIBC_2.2.5 still required, GLIBC_2.38 weak
    assert peer.old_glibc_copy(data) == 0  # nothing left to rename
    with pytest.raises(ValueError, match="ELF64"):
        peer.old_glibc_copy(bytearray(b"#!/bin/sh\n" + bytes(64)))


def test_llama_cpp_decodes_token_ids_greedily_and_alike_twice():
    pytest.importorskip(peer.BINDING, reason=f"the optional peer binding is not installed ({peer.INSTALL})")
    gguf = peer.peer_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        pytest.skip(f"the peer's GGUF file is not in {gguf.parent} (python -m scripts.llama_cpp_peer fetches it)")
    ffi, lib = peer.binding()
    llama = peer.LlamaCpp(ffi, lib, gguf, threads=1, n_ctx=128)
    try:
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198, 19556, 28, 638, 359, 346, 47, 2, 198]
        first, again = (llama.generate(prompt, 6, ()) for _ in range(2))
        stopped = llama.generate(prompt, 6, (first.tokens[1],))
    finally:
        llama.close()
    assert len(first.tokens) == 6 and all(0 <= t < 49152 for t in first.tokens)
    assert again.tokens == first.tokens  # greedy, from an emptied cache
    assert stopped.tokens == first.tokens[:2]  # a stop id ends the run after it
    assert first.prompt_s > 0 and first.decode_tokens_per_s > 0 and first.own_decode_s > 0
