"""benchmarks/split_sweep.py's pure parts on the CPU: its rows, the splits it times, the cells it
prints and its CLI."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from benchmarks import split_sweep
from benchmarks.cases import CASES

from repo_paths import ROOT


def test_every_default_row_is_a_benchmark_row():
    assert set(split_sweep.ROWS) <= {case.name for case in CASES}


def test_the_splits_are_the_planners_then_each_shorter_chunk_then_one_item_a_request():
    splits = split_sweep.splits_to_time(2048, (4096, 128, 512, 2048, 512))
    assert list(splits) == ["planned", "chunk 128", "chunk 512", split_sweep.ONE_ITEM]
    assert splits["planned"] == {} and splits["chunk 512"] == {"chunk_tokens": 512}
    assert splits[split_sweep.ONE_ITEM] == {"disable_split_kv": True}


def test_a_cell_gives_the_time_and_its_ratio_or_the_error():
    assert split_sweep.cell({"us": 12.0}, "us", 10.0) == "   12.0 (1.20)"
    assert split_sweep.cell({"us": 12.0}, "us", None) == "   12.0"
    assert split_sweep.cell({"error": "rows off the reference"}, "us", 10.0) == "rows off the reference"
    assert split_sweep.cell({"us": 9.0, "graph_error": "replay NaN"}, "graph_us", 10.0) == "replay NaN"


@pytest.mark.parametrize("text", ["", "128,x", "0,256", "-5"])
def test_a_bad_chunk_list_is_refused_naming_it(text):
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated list of positive ints"):
        split_sweep.parse_chunks(text)


def test_the_cli_documents_itself_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "benchmarks.split_sweep", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "--chunks" in done.stdout


def test_each_split_is_set_against_the_fastest_peer():
    peers = {"sdpa-cudnn": {"us": 12.0, "graph_us": 11.0}, "fa3": {"us": 10.0}, "broken": {"error": "off"}}
    best = {key: split_sweep.best_peer(peers, key) for key in ("us", "graph_us")}
    assert best == {"us": 10.0, "graph_us": 11.0}
    assert split_sweep.against_peer({"us": 8.0, "graph_us": 11.0}, best) == "  ÷ best peer 1.25x / 1.00x"
    assert split_sweep.against_peer({"us": 8.0}, {"us": None, "graph_us": None}) == ""
    assert split_sweep.best_peer({}, "us") is None
