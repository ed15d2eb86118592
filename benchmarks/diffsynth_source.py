"""DiffSynth-Studio's own pipelines through unitgraph (issue #41): a split stage-2 step against an unsplit step, per
pipeline, at test size; each stage's memory at the released sizes from the dry run; how many of the wheel's
pipelines train this way.

Runs in `.venv-diffsynth` (scripts/setup_diffsynth.sh). For each pipeline of `diffsynth_source/glue.py`: its tiny
`./models` (diffsynth_source/tiny.py), 8 images at 32 px (a video pipeline: 8 clips of 5 frames; 4 for a pipeline whose
classes fix a large size), a LoRA of rank 4 on the denoiser; the unsplit run (`sft`)
and stage 2 (`sft:train`, from a cache stage 1 made once) train the same 16 steps, alternating over `rounds` rounds
after one uncounted run of each; each figure is the median step over the rounds' medians (a run's first step,
which pays one-off set-up, left out). One process; nothing else should run on the machine meanwhile.

    .venv-diffsynth/bin/python benchmarks/diffsynth_source.py [--rounds 3] [--write | --only MODULE,...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from diffsynth_env import any_attention_kernel  # noqa: E402  (Krea 2's DiT on a CPU, as the tests run it)
from docsection import installed_versions, write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- diffsynth-source:begin -->", "<!-- diffsynth-source:end -->"
TITLE = "## DiffSynth-Studio's own pipelines (`--pipeline diffsynth:MODULE`)"
SAMPLES, SIDE, EPOCHS = 8, 32, 2
LORA = {"stable_diffusion": ("unet", "to_q,to_k,to_v,to_out.0"),
        "ideogram4": ("dit", "attention.qkv,attention.o,feed_forward.w1,feed_forward.w2,feed_forward.w3,adaln_modulation"),
        "z_image": ("dit", "to_q,to_k,to_v,to_out.0,w1,w2,w3"),
        "stable_diffusion_xl": ("unet", "to_q,to_k,to_v,to_out.0"),
        "wan_video": ("dit", "q,k,v,o,ffn.0,ffn.2"),
        "flux2_image": ("dit", "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,linear_in,"
                               "linear_out,to_qkv_mlp_proj"),
        "anima_image": ("dit", ""),
        "ernie_image": ("dit", "to_q,to_k,to_v,to_out.0"),
        "krea2": ("dit", "wq,wk,wv,gate,wo,up,down,first,tmlp.0,tmlp.2,projector,txtmlp.1,txtmlp.3,last.linear,tproj.1"),
        "lingbot_video": ("dit", "to_q,to_k,to_v,to_out"),
        "mova_audio_video": ("video_dit", "q,k,v,o,ffn.0,ffn.2"),
        "ace_step": ("dit", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
        "qwen_image": ("dit", "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,"
                              "img_mod.1,txt_mlp.net.2,txt_mod.1"),
        "boogu_image": ("dit", "to_q,to_k,to_v,to_out.0,img_to_q,img_to_k,img_to_v,img_out,instruct_to_q,instruct_to_k,"
                               "instruct_to_v,instruct_out"),
        "joyai_image": ("dit", "img_attn_qkv,txt_attn_qkv,img_attn_proj,txt_attn_proj"),
        "hidream_o1_image": ("dit", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,attn.qkv,attn.proj,"
                                    "mlp.linear_fc1,mlp.linear_fc2")}
# pipelines whose classes fix a large size (Anima's DiT, the text encoders of ERNIE-Image, Krea 2, LingBot-Video,
# Qwen-Image, Boogu-Image and JoyAI-Image; HiDream-O1's DiT): 4 samples each, so a run is 8 steps
HEAVY, HEAVY_SAMPLES = ("anima_image", "ernie_image", "krea2", "lingbot_video", "qwen_image", "boogu_image",
                        "joyai_image", "hidream_o1_image"), 4
FRAMES = 5  # a video pipeline's clips: 5 frames (4k+1) of 32 px
SONG_SECONDS = 1.3  # an audio pipeline's songs
# the released files of each pipeline's DiffSynth example, for the dry run (nothing is downloaded)
RELEASED = {
    "stable_diffusion": ("AI-ModelScope/stable-diffusion-v1-5:text_encoder/model.safetensors,"
                         "AI-ModelScope/stable-diffusion-v1-5:unet/diffusion_pytorch_model.safetensors,"
                         "AI-ModelScope/stable-diffusion-v1-5:vae/diffusion_pytorch_model.safetensors", 32),
    "ideogram4": ("DiffSynth-Studio/ideogram-4-bf16-repackage:transformer/diffusion_pytorch_model.safetensors,"
                  "DiffSynth-Studio/ideogram-4-bf16-repackage:text_encoder/model.safetensors,"
                  "DiffSynth-Studio/ideogram-4-bf16-repackage:vae/diffusion_pytorch_model.safetensors", 32),
    "stable_diffusion_xl": ("stabilityai/stable-diffusion-xl-base-1.0:text_encoder/model.safetensors,"
                            "stabilityai/stable-diffusion-xl-base-1.0:text_encoder_2/model.safetensors,"
                            "stabilityai/stable-diffusion-xl-base-1.0:unet/diffusion_pytorch_model.safetensors,"
                            "stabilityai/stable-diffusion-xl-base-1.0:vae/diffusion_pytorch_model.safetensors", 32),
    "z_image": ("Tongyi-MAI/Z-Image-Turbo:transformer/*.safetensors,Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors,"
                "Tongyi-MAI/Z-Image-Turbo:vae/diffusion_pytorch_model.safetensors", 32),
    "wan_video": ("Wan-AI/Wan2.1-T2V-1.3B:diffusion_pytorch_model*.safetensors,"
                  "Wan-AI/Wan2.1-T2V-1.3B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.1-T2V-1.3B:Wan2.1_VAE.pth", 32),
    "flux2_image": ("black-forest-labs/FLUX.2-klein-4B:text_encoder/*.safetensors,"
                    "black-forest-labs/FLUX.2-klein-4B:transformer/*.safetensors,"
                    "black-forest-labs/FLUX.2-klein-4B:vae/diffusion_pytorch_model.safetensors", 32),
    "anima_image": ("circlestone-labs/Anima:split_files/diffusion_models/anima-preview.safetensors,"
                    "circlestone-labs/Anima:split_files/text_encoders/qwen_3_06b_base.safetensors,"
                    "circlestone-labs/Anima:split_files/vae/qwen_image_vae.safetensors", 32),
    "ernie_image": ("PaddlePaddle/ERNIE-Image:transformer/diffusion_pytorch_model*.safetensors,"
                    "PaddlePaddle/ERNIE-Image:text_encoder/model.safetensors,"
                    "PaddlePaddle/ERNIE-Image:vae/diffusion_pytorch_model.safetensors", 32),
    "krea2": ("krea/Krea-2-Raw:raw.safetensors,Qwen/Qwen3-VL-4B-Instruct:*.safetensors,"
              "Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors", 32),
    "lingbot_video": ("Robbyant/lingbot-video-dense-1.3b:transformer/diffusion_pytorch_model.safetensors,"
                      "Qwen/Qwen3-VL-4B-Instruct:*.safetensors,"
                      "Robbyant/lingbot-video-dense-1.3b:vae/diffusion_pytorch_model.safetensors", 32),
    "mova_audio_video": ("openmoss/MOVA-360p:video_dit/diffusion_pytorch_model-*.safetensors,"
                         "openmoss/MOVA-360p:audio_dit/diffusion_pytorch_model.safetensors,"
                         "openmoss/MOVA-360p:dual_tower_bridge/diffusion_pytorch_model.safetensors,"
                         "openmoss/MOVA-720p:audio_vae/diffusion_pytorch_model.safetensors,"
                         "DiffSynth-Studio/Wan-Series-Converted-Safetensors:Wan2.1_VAE.safetensors,"
                         "DiffSynth-Studio/Wan-Series-Converted-Safetensors:models_t5_umt5-xxl-enc-bf16.safetensors", 32),
    "ace_step": ("ACE-Step/Ace-Step1.5:acestep-v15-turbo/model.safetensors,"
                 "ACE-Step/Ace-Step1.5:Qwen3-Embedding-0.6B/model.safetensors,"
                 "ACE-Step/Ace-Step1.5:vae/diffusion_pytorch_model.safetensors", 32),
    "qwen_image": ("Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,"
                   "Qwen/Qwen-Image:text_encoder/model*.safetensors,"
                   "Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors", 32),
    "boogu_image": ("Boogu/Boogu-Image-0.1-Base:transformer/*.safetensors,Boogu/Boogu-Image-0.1-Base:mllm/*.safetensors,"
                    "Boogu/Boogu-Image-0.1-Base:vae/*.safetensors", 32),
    "joyai_image": ("jd-opensource/JoyAI-Image-Edit:transformer/transformer.pth,"
                    "jd-opensource/JoyAI-Image-Edit:JoyAI-Image-Und/model*.safetensors,"
                    "jd-opensource/JoyAI-Image-Edit:vae/Wan2.1_VAE.pth", 32),
    "hidream_o1_image": ("HiDream-ai/HiDream-O1-Image-Dev:model-*.safetensors", 32),
}


def _args(module: str, **over: Any) -> Any:
    from unitgraph.backends.diffusion.args import make_args

    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for

    base, targets = LORA[module]
    size = {} if glue_for(module).media == "audio" else {"height": side(module), "width": side(module)}  # songs: none
    # an edit pipeline's example hands the picture it edits (JoyAI-Image's)
    edit = {"data_file_keys": "image,edit_image", "extra_inputs": "edit_image"} if glue_for(module).edits else {}
    return make_args(**{"pipeline": f"diffsynth:{module}", "lora_base_model": base, "lora_target_modules": targets,
                        "lora_rank": 4, **size, **edit, "num_epochs": EPOCHS, "seed": 1, **over})


def side(module: str) -> int:
    """The pictures' side: SIDE, or twice the pipeline's patch where SIDE gives it fewer patches than it takes
    (HiDream-O1's 32 px patches: 64 px, 2x2 of them)."""
    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for

    glue = glue_for(module)
    return SIDE if (SIDE // glue.division) ** 2 >= glue.min_cells else 2 * glue.division


def _median_step(result: Any) -> float:
    return statistics.median(result.step_times[1:])


def measure(module: str, rounds: int, root: Path) -> dict[str, Any]:
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset
    from unitgraph.backends.diffusion.diffsynth_source.run import run
    from unitgraph.backends.diffusion.diffsynth_source.tiny import write_tiny_models

    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for
    from unitgraph.backends.diffusion.diffsynth_source.run import setup

    folder = root / module
    flags = write_tiny_models(folder / "models", module)
    video, sound = glue_for(module).media == "video", bool(glue_for(module).audio)
    song = glue_for(module).media == "audio"
    write_synthetic_dataset(folder / "data", count=HEAVY_SAMPLES if module in HEAVY else SAMPLES, size=40,
                            edit=glue_for(module).edits,
                            **({"videos": ("video",), "frames": FRAMES, "audio": sound} if video else {}),
                            **({"songs": SONG_SECONDS} if song else {}))
    os.environ["DIFFSYNTH_MODEL_BASE_PATH"] = str(folder / "models")
    os.environ["DIFFSYNTH_SKIP_DOWNLOAD"] = "True"
    folders = {k: v for k, v in flags.items() if k in ("tokenizer_path", "tokenizer_t5xxl_path", "processor_path",
                                                       "silence_latent_path")}
    both = {**folders, **({"num_frames": FRAMES, "data_file_keys": "video"} if video else {}),
            **({"data_file_keys": "audio"} if song else {}),  # ACE-Step's example: songs
            # MOVA's example: the clip's sound and first frame
            **({"data_file_keys": "video,input_audio", "extra_inputs": "input_audio,input_image"} if sound else {})}
    data = {"dataset_base_path": str(folder / "data"), "dataset_metadata_path": str(folder / "data" / "metadata.csv"),
            "model_id_with_origin_paths": flags["model_id_with_origin_paths"], **both}
    quiet = lambda _line: None  # noqa: E731
    began = time.perf_counter()
    stage1 = run(_args(module, task="sft:data_process", output_path=str(folder / "cache"), **data), quiet)
    stage1_s = time.perf_counter() - began
    # stage 2 names only the files of the models it trains with (not the text encoder's, nor the VAE's when stage 1
    # has it alone)
    planned = setup(_args(module, **data))
    given = flags["model_id_with_origin_paths"].split(",")
    stage2_ids = ",".join(i for i, m in zip(given, planned.models) if set(m.attributes) & set(planned.plan.train_models))
    runs = {
        "unsplit": lambda out: run(_args(module, output_path=out, **data), quiet),
        "stage 2": lambda out: run(_args(module, task="sft:train", dataset_base_path=str(folder / "cache"),
                                         model_id_with_origin_paths=stage2_ids, output_path=out, **both), quiet),
    }
    for name, go in runs.items():  # one uncounted run of each
        go(str(folder / f"warm-{name.replace(' ', '')}"))
    medians: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            result = runs[name](str(folder / f"r{r}-{name.replace(' ', '')}"))
            medians[name].append(_median_step(result))
            losses[name] = result.losses
    shutil.rmtree(folder, ignore_errors=True)  # its released-size files (up to 17.5 GB) gone before the next's
    return {"stage1_s": stage1_s, "entries": stage1.entries_computed, "plan": stage1.plan, "given": planned.given,
            "unsplit_ms": 1000 * statistics.median(medians["unsplit"]),
            "stage2_ms": 1000 * statistics.median(medians["stage 2"]),
            "equal": losses["unsplit"] == losses["stage 2"], "steps": len(losses["unsplit"])}


def released(module: str) -> dict[str, Any]:
    from unitgraph.backends.diffusion.diffsynth_source.run import run

    ids, rank = RELEASED[module]
    base, targets = LORA[module]
    with tempfile.TemporaryDirectory() as empty:
        os.environ["DIFFSYNTH_MODEL_BASE_PATH"] = empty
        return run(_args(module, dry_run=True, model_id_with_origin_paths=ids, lora_rank=rank), lambda _l: None).memory_plan


def wheel_pipelines() -> list[str]:
    import diffsynth

    return sorted(p.stem for p in (Path(diffsynth.__file__).parent / "pipelines").glob("*.py") if p.stem != "__init__")


def render(found: dict[str, Any], plans: dict[str, Any], rounds: int, started: str, ended: str) -> str:
    from unitgraph.backends.diffusion.diffsynth_source.glue import glues

    gib = 1024 ** 3
    lines = [f"Measured {started} to {ended} on this machine ({os.cpu_count()} cores; "
             f"{installed_versions(('torch', 'diffsynth', 'peft'))}), in `.venv-diffsynth`, by "
             f"`benchmarks/diffsynth_source.py --rounds {rounds}`: each pipeline's test-size models from DiffSynth's "
             f"own classes, {SAMPLES} images at {SIDE} px (HiDream-O1's at 64: 2x2 of its 32 px patches; a video "
             f"pipeline's: {SAMPLES} clips of {FRAMES} frames; "
             f"an audio pipeline's: {SAMPLES} songs of {SONG_SECONDS} s; "
             f"{HEAVY_SAMPLES} for a pipeline whose classes fix a large size: {', '.join(HEAVY)}), a rank-4 LoRA on "
             f"the denoiser, {EPOCHS} epochs; the median step of the unsplit run and of stage 2, alternating, median "
             "over the rounds (Krea 2's DiT, which asks torch for cuDNN's attention kernel alone, with torch's math "
             "kernel on this CPU).", "",
             "| pipeline | stage 1 runs | stage 2 runs | stage 1 (s) | unsplit step (ms) | stage-2 step (ms) | "
             "stage 2 / unsplit | losses equal |", "|---|---|---|---|---|---|---|---|"]
    for module, f in found.items():
        plan = f["plan"]
        # as the run's plan line
        named = lambda models: ", ".join(m for m in models if m in f["given"]) or "no model"  # noqa: E731
        lines.append(f"| `diffsynth:{module}` | {', '.join(plan.data_process_units)} ({named(plan.data_process_models)}) "
                     f"| {', '.join(plan.train_units) or 'the loss'} ({named(plan.train_models)}) | "
                     f"{f['stage1_s']:.1f} | {f['unsplit_ms']:.1f} | {f['stage2_ms']:.1f} | "
                     f"{f['stage2_ms'] / f['unsplit_ms']:.2f}x | {'yes' if f['equal'] else 'NO'} ({f['steps']} steps) |")
    lines += ["", "The dry run of each DiffSynth example at the released sizes (DiffSynth's model configs on the meta "
              "device, no file read or downloaded; weights in the example's dtype, a rank-32 LoRA's gradients and AdamW "
              "state; activations not counted):", "",
              "| pipeline | dtype | stage 1 (GiB) | stage 2 (GiB) | unsplit (GiB) | stage 2 / unsplit |",
              "|---|---|---|---|---|---|"]
    for module, plan in plans.items():
        s = plan["stages"]
        lines.append(f"| `diffsynth:{module}` | {plan['dtype']} | {s['data_process']['total'] / gib:.2f} | "
                     f"{s['train']['total'] / gib:.2f} | {s['unsplit']['total'] / gib:.2f} | "
                     f"{s['train']['total'] / s['unsplit']['total']:.2f}x |")
    wheel = wheel_pipelines()
    lines += ["", f"Pipelines: {len(glues())} of the {len(wheel)} in the installed wheel ({', '.join(wheel)}) train "
              f"through DiffSynth's own code: {', '.join(g.name for g in glues())} (docs/diffsynth.md says what the "
              "others need)."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help=f"write the results into {DOC.relative_to(ROOT)}")
    parser.add_argument("--only", default="", help="measure these pipelines only (comma-separated modules; printed, "
                                                    "not written: the section holds every pipeline)")
    args = parser.parse_args(argv)
    only = [m for m in args.only.split(",") if m]
    if only and args.write:
        parser.error("--only measures part of the section; run without it to --write")
    if set(only) - set(LORA):
        parser.error(f"--only: unknown pipelines {sorted(set(only) - set(LORA))} (measured: {', '.join(LORA)})")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="unitgraph-bench-ds-") as tmp:
        found = {}
        for module in only or LORA:
            with any_attention_kernel(module):
                found[module] = measure(module, args.rounds, Path(tmp))
    plans = {module: released(module) for module in RELEASED if not only or module in only}
    text = render(found, plans, args.rounds, started, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(text)
    if args.write:
        write_section(DOC, BEGIN, END, TITLE, text)


if __name__ == "__main__":
    main()
