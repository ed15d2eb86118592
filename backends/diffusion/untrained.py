"""DiffSynth-Studio's families that unitgraph does not train, known by their model ids and diffusers classes, so a
command of theirs is named as such in one line before anything is downloaded or loaded.

Without this, a model id no family declares gives the pipeline choice no signal, the run falls back to the first
registered family (Qwen-Image), tries to download the files and ends in a class mismatch that names Qwen-Image's
classes: the user learns late, and wrongly, what went on. The table lists the model ids of DiffSynth's example
folders (`examples/<folder>/model_training/`) for the families unitgraph has no pipeline of, as DiffSynth 2.1's
repository has them; a model id of one of them, or a diffusers class no family loads, stops the run at the choice of
its pipeline (choice.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Untrained", "UNTRAINED", "untrained_by_model_id"]


@dataclass(frozen=True)
class Untrained:
    """A DiffSynth family unitgraph does not train: its name, DiffSynth's example folder, its model ids (and id
    prefixes ending in "/" or "-", for organisations or series that are the family's alone)."""

    name: str
    folder: str
    model_ids: tuple[str, ...]

    def names(self, model_id: str) -> bool:
        return any(model_id == known or (known.endswith(("/", "-")) and model_id.startswith(known))
                   for known in self.model_ids)


UNTRAINED: tuple[Untrained, ...] = (
    Untrained("ACE-Step", "ace_step", ("ACE-Step/",)),
    Untrained("Anima", "anima", ("circlestone-labs/Anima",)),
    Untrained("Boogu-Image", "boogu_image", ("Boogu/",)),
    Untrained("ERNIE-Image", "ernie_image", ("PaddlePaddle/ERNIE-Image",)),
    Untrained("HiDream-O1-Image", "hidream_o1_image", ("HiDream-ai/HiDream-O1-",)),
    Untrained("Ideogram 4", "ideogram4", ("ideogram-ai/ideogram-4-", "DiffSynth-Studio/ideogram-4-")),
    Untrained("JoyAI-Image", "joyai_image", ("jd-opensource/JoyAI-Image-",)),
    Untrained("Krea 2", "krea2", ("krea/Krea-2-",)),
    Untrained("LingBot-Video", "lingbot_video", ("Robbyant/lingbot-video-",)),
    Untrained("MiniMax-H3", "minimax_h3", ("MiniMax/MiniMax-H3", "Comfy-Org/MiniMax-H3", "DiffSynth-Studio/MiniMax-H3-")),
    Untrained("MOVA", "mova", ("openmoss/MOVA-",)),
)


def untrained_by_model_id(model_id: str) -> Optional[Untrained]:
    """The untrained DiffSynth family a model id belongs to, or None.

    >>> untrained_by_model_id("PaddlePaddle/ERNIE-Image").folder
    'ernie_image'
    >>> untrained_by_model_id("Qwen/Qwen-Image") is None
    True
    """
    return next((family for family in UNTRAINED if family.names(model_id)), None)
