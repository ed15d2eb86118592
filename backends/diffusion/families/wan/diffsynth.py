"""Wan as DiffSynth-Studio's own pipeline (`--pipeline diffsynth:wan_video`, backends/diffusion/diffsynth_source):
how its example's train.py builds it, and its test-size models in DiffSynth's `./models` layout.

DiffSynth's Wan 2.1 T2V command names `Wan-AI/Wan2.1-T2V-1.3B:models_t5_umt5-xxl-enc-bf16.pth` and
`...:Wan2.1_VAE.pth`; its `from_pretrained` redirects both to DiffSynth's own safetensors copies
(`DiffSynth-Studio/Wan-Series-Converted-Safetensors`), and so does unitgraph (models.py `redirects`), so no pickle is
read. The test-size models are written where those redirects look.

MOVA (`diffsynth:mova_audio_video`, DiffSynth's pipeline of OpenMOSS's image-to-audio-and-video model) is declared
here too: its video tower is Wan's DiT, and it encodes with Wan's VAE and T5 from the same converted copies. Beside
them it loads an audio DiT (Wan's class, one-dimensional), a bridge of cross-attention between the two towers, and
a DAC audio VAE; its example trains with DiffSynth's FlowMatchSFTAudioVideoLoss on a clip and its own sound track.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...family import DiffSynthPipeline, DiffSynthTokenizer

MODEL_ID = "Wan-AI/Wan2.1-T2V-1.3B"
CONVERTED = "DiffSynth-Studio/Wan-Series-Converted-Safetensors"

MOVA_ID, MOVA_720P = "openmoss/MOVA-360p", "openmoss/MOVA-720p"
WAN22_I2V_A14B = "md5:5b013604280dd715f8457c6ed6d6a626"  # the table's entry of Wan2.2-I2V-A14B's experts

PIPELINES = (
    DiffSynthPipeline("wan_video", "WanVideoPipeline", "Wan 2.1/2.2 video (DiffSynth's pipeline)", example="wanvideo",
                      tokenizers=(DiffSynthTokenizer("tokenizer_config", "tokenizer_path", MODEL_ID, "google/umt5-xxl/"),),
                      columns=("video", "prompt"), media="video", frames=(4, 1),
                      constants=(("tiled", False), ("cfg_merge", False), ("vace_scale", 1)), boundaries=True,
                      negative=None, checkpointing=True),
    # its train.py defaults the tokenizer to Gemma 3's folder (HuggingfaceTokenizer reads whatever is there), reads clips
    # at --frame_rate and their sound through LoadAudioWithTorchaudio, and hands no negative side and no seed
    DiffSynthPipeline("mova_audio_video", "MovaAudioVideoPipeline", "MOVA audio and video (DiffSynth's pipeline)",
                      example="mova",
                      tokenizers=(DiffSynthTokenizer("tokenizer_config", "tokenizer_path",
                                                     "google/gemma-3-12b-it-qat-q4_0-unquantized", ""),),
                      columns=("video", "prompt"), media="video", frames=(4, 1), constants=(("tiled", False),),
                      boundaries=True, negative=None, distill=False,
                      loss="diffsynth.diffusion.loss:FlowMatchSFTAudioVideoLoss", audio=("input_audio",),
                      audio_latents="audio_input_latents",
                      frame_rate=True, on_loaded=("set_to_torch_norm",), first_frame=True,
                      # DiffSynth's table names MOVA's audio DiT and bridge under MOVA-720p's example, and its video
                      # experts under none: they are Wan 2.2 I2V A14B's DiT class and size (5120 wide, 40 blocks, the
                      # first frame's 20 channels beside the 16 latent ones, no CLIP image input: the bridge's
                      # defaults are that width and depth), so the dry run sizes them by that entry
                      sized_as=((f"{MOVA_ID}:video_dit/diffusion_pytorch_model-*.safetensors", WAN22_I2V_A14B),
                                (f"{MOVA_ID}:video_dit_2/diffusion_pytorch_model-*.safetensors", WAN22_I2V_A14B),
                                (f"{MOVA_ID}:audio_dit/diffusion_pytorch_model.safetensors",
                                 f"{MOVA_720P}:audio_dit/diffusion_pytorch_model.safetensors"),
                                (f"{MOVA_ID}:dual_tower_bridge/diffusion_pytorch_model.safetensors",
                                 f"{MOVA_720P}:dual_tower_bridge/diffusion_pytorch_model.safetensors"),
                                # the converted copies, which the table knows by the .pth files they convert
                                (f"{CONVERTED}:Wan2.1_VAE.safetensors", "Wan-AI/Wan2.1-T2V-14B:Wan2.1_VAE.pth"),
                                (f"{CONVERTED}:models_t5_umt5-xxl-enc-bf16.safetensors",
                                 "Wan-AI/Wan2.1-T2V-14B:models_t5_umt5-xxl-enc-bf16.pth"))),
)

# DiffSynth's Wan classes take their sizes in their constructors, except the VAE's (z_dim 16, 127 M parameters,
# which the tests write at that size in bf16: 254 MB, known to DiffSynth's table by its key hash). The DiT and the T5
# encoder are test-sized; each is recognised by the config.json beside it, the DiT's with the release's own keys.
DIT = {"dim": 24, "in_dim": 16, "ffn_dim": 48, "out_dim": 16, "text_dim": 32, "freq_dim": 256, "eps": 1e-6,
       "patch_size": [1, 2, 2], "num_heads": 2, "num_layers": 2, "model_type": "t2v", "text_len": 512}
T5 = {"dim": 32, "dim_attn": 32, "dim_ffn": 64, "num_heads": 4, "num_layers": 2, "num_buckets": 8}


def _random(module: Any, seed: int) -> dict[str, Any]:
    """`module`'s weights drawn N(0, 0.02) (norm scales 1) from `seed`, in bf16 as the releases are."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02, generator=generator)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in module.state_dict().items()}


def write_diffsynth_models(outdir: Path, module: str, seed: int = 0) -> dict[str, Any]:
    """Wan 2.1 T2V as DiffSynth's example downloads it under `outdir`: the DiT in `Wan-AI/Wan2.1-T2V-1.3B/` beside
    its config.json, the umt5 tokenizer in its `google/umt5-xxl/`, the T5 encoder and the VAE in DiffSynth's
    converted copies. Returns the flags naming them as the example does (its .pth names, which are redirected).
    MOVA's (`module` mova_audio_video): `_write_mova`."""
    from diffsynth.models.wan_video_dit import WanModel
    from safetensors.torch import save_file

    if module == "mova_audio_video":
        return _write_mova(Path(outdir), seed)
    root = Path(outdir) / MODEL_ID
    root.mkdir(parents=True, exist_ok=True)
    _write_converted(Path(outdir), root / "google" / "umt5-xxl", seed)
    dit_kwargs = {k: v for k, v in DIT.items() if k not in ("model_type", "text_len")}
    dit = WanModel(**{**dit_kwargs, "patch_size": tuple(DIT["patch_size"]), "has_image_input": False})
    save_file(_random(dit, seed), str(root / "diffusion_pytorch_model.safetensors"))
    (root / "config.json").write_text(json.dumps({"_class_name": "WanModel", **DIT}, indent=1) + "\n", encoding="utf-8")
    files = [f"{MODEL_ID}:diffusion_pytorch_model*.safetensors", f"{MODEL_ID}:models_t5_umt5-xxl-enc-bf16.pth",
             f"{MODEL_ID}:Wan2.1_VAE.pth"]
    return {"model_id_with_origin_paths": ",".join(files), "tokenizer_path": str(root / "google" / "umt5-xxl")}


def _write_converted(outdir: Path, tokenizer_folder: Path, seed: int) -> None:
    """The test-size umt5 tokenizer in `tokenizer_folder`, the T5 encoder (test-sized, `T5`, its config.json beside
    it) and the VAE in DiffSynth's converted copies under `outdir`."""
    import torch
    from diffsynth.models.wan_video_text_encoder import WanTextEncoder
    from diffsynth.models.wan_video_vae import WanVideoVAE
    from safetensors.torch import save_file

    from ...models.tiny_tokenizers import t5_tokenizer

    converted = outdir / CONVERTED
    converted.mkdir(parents=True, exist_ok=True)
    tokenizer = t5_tokenizer()
    tokenizer.save_pretrained(str(tokenizer_folder))
    encoder = WanTextEncoder(vocab=len(tokenizer), **T5)
    save_file(_random(encoder, seed + 1), str(converted / "models_t5_umt5-xxl-enc-bf16.safetensors"))
    (converted / "config.json").write_text(json.dumps({"vocab": len(tokenizer), **T5}, indent=1) + "\n",
                                           encoding="utf-8")
    torch.manual_seed(seed + 2)
    vae = WanVideoVAE()
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in vae.model.state_dict().items()},
              str(converted / "Wan2.1_VAE.safetensors"))


# MOVA at test size: both towers 24 wide with heads of 12 (Wan's rotary axes of 4, 4 and 4; the bridge's head_dim) and 2
# blocks each, the bridge
# between every pair; the video DiT image-to-video (16 latent channels, and 20 of the first frame's mask and
# latents); the DAC audio VAE at 8 kHz with 160 samples a latent step, 50 a second as the release's 48 kHz / 960
MOVA_VIDEO_DIT = {"dim": 24, "in_dim": 36, "ffn_dim": 48, "out_dim": 16, "text_dim": T5["dim"], "freq_dim": 256,
                  "eps": 1e-6, "patch_size": [1, 2, 2], "num_heads": 2, "num_layers": 2, "has_image_input": False}
MOVA_AUDIO_DIT = {**MOVA_VIDEO_DIT, "in_dim": 8, "out_dim": 8, "patch_size": [1]}
MOVA_BRIDGE = {"visual_layers": 2, "audio_layers": 2, "visual_hidden_dim": 24, "audio_hidden_dim": 24, "head_dim": 12}
MOVA_AUDIO_VAE = {"encoder_dim": 8, "encoder_rates": [4, 5, 8], "latent_dim": 8, "decoder_dim": 16,
                  "decoder_rates": [8, 5, 4], "sample_rate": 8000}
MOVA_GEMMA = "google/gemma-3-12b-it-qat-q4_0-unquantized"


def _write_mova(outdir: Path, seed: int) -> dict[str, Any]:
    """MOVA 360p image-to-audio-and-video as its LoRA examples download it: openmoss/MOVA-360p's video_dit and
    video_dit_2 (the high- and the low-noise expert, two shards each), audio_dit and dual_tower_bridge, MOVA-720p's audio_vae, each test-sized with its config.json beside it; Wan's T5
    and VAE in DiffSynth's converted copies; the test-size umt5 tokenizer where its train.py looks by default (Gemma
    3's folder). Returns the flags naming them as the example does."""
    import torch
    from diffsynth.models.mova_audio_dit import MovaAudioDit
    from diffsynth.models.mova_audio_vae import DacVAE
    from diffsynth.models.mova_dual_tower_bridge import DualTowerConditionalBridge
    from diffsynth.models.wan_video_dit import WanModel
    from safetensors.torch import save_file

    def folder(model_id: str, name: str, config: dict, cls: type) -> Path:
        where = outdir / model_id / name
        where.mkdir(parents=True, exist_ok=True)
        (where / "config.json").write_text(json.dumps({"_class_name": cls.__name__, **config}, indent=1) + "\n",
                                           encoding="utf-8")
        return where

    def sized(config: dict) -> dict:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}

    _write_converted(outdir, outdir / MOVA_GEMMA, seed)
    for offset, name in enumerate(("video_dit", "video_dit_2")):  # the high-noise and the low-noise experts
        video = _random(WanModel(**sized(MOVA_VIDEO_DIT)), seed + 3 + 10 * offset)
        names = sorted(video)
        where = folder(MOVA_ID, name, MOVA_VIDEO_DIT, WanModel)
        for part, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2:]), start=1):
            save_file({k: video[k] for k in chunk},
                      str(where / f"diffusion_pytorch_model-0000{part}-of-00002.safetensors"))
    save_file(_random(MovaAudioDit(**sized(MOVA_AUDIO_DIT)), seed + 4),
              str(folder(MOVA_ID, "audio_dit", MOVA_AUDIO_DIT, MovaAudioDit) / "diffusion_pytorch_model.safetensors"))
    save_file(_random(DualTowerConditionalBridge(**MOVA_BRIDGE), seed + 5),
              str(folder(MOVA_ID, "dual_tower_bridge", MOVA_BRIDGE, DualTowerConditionalBridge) / "diffusion_pytorch_model.safetensors"))
    torch.manual_seed(seed + 6)
    audio_vae = DacVAE(**MOVA_AUDIO_VAE)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in audio_vae.state_dict().items()},
              str(folder(MOVA_720P, "audio_vae", MOVA_AUDIO_VAE, DacVAE) / "diffusion_pytorch_model.safetensors"))
    files = [f"{MOVA_ID}:video_dit/diffusion_pytorch_model-*.safetensors",
             f"{MOVA_ID}:audio_dit/diffusion_pytorch_model.safetensors",
             f"{MOVA_ID}:dual_tower_bridge/diffusion_pytorch_model.safetensors",
             f"{MOVA_720P}:audio_vae/diffusion_pytorch_model.safetensors",
             f"{CONVERTED}:Wan2.1_VAE.safetensors", f"{CONVERTED}:models_t5_umt5-xxl-enc-bf16.safetensors"]
    return {"model_id_with_origin_paths": ",".join(files)}
