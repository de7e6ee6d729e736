"""scripts/bench_compile.py refuses arguments it cannot measure with one usage line (exit 2), before any work."""

import pytest

from script_modules import load_script


@pytest.mark.parametrize("argv, message", [
    (["--layers", "4", "0"], "--layers must be >= 1, got 0"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--devices", "3"], "--devices: each must divide the 8 experts, got [3]"),
    (["--cache-fraction", "1.5"], "--cache-fraction must be in (0, 1], got 1.5"),
    (["--top-k", "9"], "--top-k 9 is more than the 8 experts"),
    (["--policies", "qstar", "bogus"], "--policies: policy: unknown policy 'bogus'"),
])
def test_bad_arguments_are_one_usage_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        load_script("bench_compile").main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"bench_compile.py: error: {message}" in err or f"error: {message}" in err
    assert "Traceback" not in err
