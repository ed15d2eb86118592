"""The in-process runner of pasted commands (tests/pasted.py) hands the program what bash hands it."""

from __future__ import annotations

import subprocess

import pytest

from pasted import commands

BASH_ARGV = r"""unitgraph() { for a in "$@"; do printf '%s\0' "$a"; done; printf '\1\0'; }
"""


def bash_argvs(script: str) -> list[list[str]]:
    """The arguments bash gives each `unitgraph` command of the script (a shell function stands in for the program)."""
    done = subprocess.run(["bash", "-c", BASH_ARGV + script], capture_output=True, timeout=30, check=True)
    argvs, current = [], []
    for word in done.stdout.decode().split("\0")[:-1]:
        if word == "\1":
            argvs.append(current)
            current = []
        else:
            current.append(word)
    return argvs


def ported_scripts() -> dict[str, str]:
    import test_flux2
    import test_ltx2
    import test_sdxl
    import test_z_image

    scripts = {"flux2_klein": test_flux2.DIFFSYNTH_COMMANDS, "flux2_dev": test_flux2.DEV_COMMANDS,
               "z_image": test_z_image.DIFFSYNTH_COMMAND, "z_image_omni": test_z_image.DIFFSYNTH_OMNI_COMMAND,
               "sdxl": test_sdxl.DIFFSYNTH_COMMAND}
    for name, (stage1, stage2, *_rest) in test_ltx2.DIFFSYNTH_COMMANDS.items():
        scripts[f"ltx2_{name}"] = stage1.format(encoders="a:b/*.safetensors") + stage2.format(dit="c:d/*.safetensors")
    return scripts


def test_the_ported_scripts_split_as_bash_splits_them():
    pytest.importorskip("torch")
    for name, script in ported_scripts().items():
        ours = [argv[1:] for argv in commands(script)]
        assert ours and ours == bash_argvs(script), name


@pytest.mark.parametrize("script", [
    'unitgraph train --output_path $HOME/x',
    'unitgraph train --model_paths models/*.safetensors',
    'unitgraph train --x 1 | tee log',
    'unitgraph train --x 1 > log',
    'unitgraph train --x 1; rm -rf y',
    'unitgraph train --x `pwd`',
])
def test_anything_more_than_quoting_is_refused(script):
    with pytest.raises(ValueError):
        commands(script)


def test_continuations_and_quotes_as_bash():
    script = 'unitgraph train \\\n  --a "x y" \\\n  --b \'*.safetensors\' --c "p:q/*.safetensors"\\\n  --d 9\n\nset -e\n'
    assert [argv[1:] for argv in commands(script)] == bash_argvs(script) == [
        ["train", "--a", "x y", "--b", "*.safetensors", "--c", "p:q/*.safetensors", "--d", "9"]]
