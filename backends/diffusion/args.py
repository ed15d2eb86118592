"""The training command's arguments: every DiffSynth-Studio flag (docs/user-guide.md), plus unitgraph's own.

One dataclass is the command line: `unitgraph train` builds its options from the fields (each in both
spellings, `--dataset_base_path` and `--dataset-base-path`), `training_args.json` is `asdict()` of it,
and `config.RunConfig.from_args` turns it, once, into the typed configs the stages read. No torch here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Optional

from .caption_dropout import check_caption_dropout
from .errors import BackendError
from .flowmatch import LOSS_WEIGHTINGS, VAE_LATENTS, TimestepSampling
from .masked_loss import check_unmasked_weight

LORA_TYPES = ("lora", "dora", "lokr", "loha")  # --lora_type: peft's LoRA, DoRA, LoKr and LoHa (models/lora.py)
MAX_FRAMES = 1025  # 4k+1 and 8k+1; 8x the longest clip a released video model trains on (121 frames)
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # PIL's Image.MAX_IMAGE_PIXELS, used when a program has set it to None


def image_pixel_limit() -> int:
    """The most pixels an image may have: PIL's Image.MAX_IMAGE_PIXELS, which the image and frame readers keep
    (data/dataset.open_image, data/video.check_pixels); its default when a program has set it to None."""
    from PIL import Image

    return int(Image.MAX_IMAGE_PIXELS or DEFAULT_MAX_IMAGE_PIXELS)


TASKS = (
    "sft", "sft:data_process", "sft:train", "sft:split",
    "direct_distill", "direct_distill:data_process", "direct_distill:train", "direct_distill:split",
)
CACHE_DTYPE_FLAGS = ("bf16", "fp16", "fp32")
MIXED_PRECISION = ("no", "fp16", "bf16")  # accelerate's names
MAX_SEED = 1 << 63
# a schedule's timesteps: the schedulers of every family train on 1000, and a render of more steps allocates a
# sigma per step before the first (10^9 of them are killed for memory after the whole training)
MAX_VALIDATION_INFERENCE_STEPS = 1000
POLYNOMIAL_LR_END = 1e-7  # diffusers' get_polynomial_decay_schedule_with_warmup: lr_end, which must be below the rate
LORA_FORMATS = ("diffusers", "diffsynth", "comfyui")
# DiffSynth's tasks that unitgraph does not train, and whose they are
OTHER_TASKS = {"trajectory_imitation": "trajectory imitation (Z-Image's distillation)", "dmd2": "DMD2 distillation",
               "cover": "cover (ACE-Step's)", "repaint": "repaint (ACE-Step's)",
               "edit_pairwise_rank": "edit_pairwise_rank (its image-quality metrics')",
               "edit_pairwise_score": "edit_pairwise_score (its image-quality metrics')",
               "edit_pointwise_score": "edit_pointwise_score (its image-quality metrics')"}
NOT_TRAINED = "a flag of DiffSynth's {what}, which unitgraph does not train"
# DiffSynth's flags refused (the "diffsynth" group of TrainArgs), with what unitgraph does instead
REFUSED_DIFFSYNTH_FLAGS = {
    "enable_swanlab_log": "SwanLab is not among accelerate's trackers; unitgraph reports with --report_to tensorboard "
                          "or wandb, and always writes loss.csv",
    "swanlab_project": "SwanLab is not among accelerate's trackers; --report_to tensorboard or wandb",
    "customized_optimizer": "unitgraph imports no class a command line names; choose the optimizer with --optimizer "
                            "adamw|adamw8bit|adafactor|prodigy|came|schedulefree (and --optimizer_args)",
    "quant_options": "unitgraph quantizes no model on loading; --fp8_models stores frozen models in fp8 "
                     "(float8_e4m3fn), computed layer by layer in the compute dtype",
    "template_model_id_or_path": NOT_TRAINED.format(what="template models"),
    "enable_lora_hot_loading": NOT_TRAINED.format(what="image-to-LoRA models"),
    "zero_cond_t": NOT_TRAINED.format(what="Qwen-Image-Edit-2511"),
    "audio_processor_path": NOT_TRAINED.format(what="speech-to-video release (S2V)"),
    "framewise_decoding": NOT_TRAINED.format(what="dance-video (ToDance) models"),
    "first_frame_as_condition": NOT_TRAINED.format(what="LingBot-Video"),
    "silent_on_missing_audio": NOT_TRAINED.format(what="MiniMax-H3"),
}
# DiffSynth's flags of a pipeline unitgraph trains only through DiffSynth's own code (--pipeline diffsynth:MODULE):
# refused by unitgraph's own pipelines (config.py), read by diffsynth_source
DIFFSYNTH_PIPELINE_FLAGS = {"tokenizer_t5xxl_path": ("Anima", "diffsynth:anima_image"),
                            "max_audio_duration": ("ACE-Step", "diffsynth:ace_step"),
                            "silence_latent_path": ("ACE-Step", "diffsynth:ace_step"),
                            "noise_scale": ("HiDream-O1-Image", "diffsynth:hidream_o1_image"),
                            "processor_config": ("HiDream-O1-Image", "diffsynth:hidream_o1_image")}
REPORT_TO = ("none", "tensorboard", "wandb")
# --lr_scheduler: DiffSynth's (torch's ConstantLR with its defaults) and diffusers' get_scheduler names (train/lr.py)
LR_SCHEDULERS = ("diffsynth", "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
                 "polynomial")


def _f(default: Any, help: str, group: str) -> Any:
    return field(default=default, metadata={"help": help, "group": group})


@dataclass
class TrainArgs:
    # dataset
    dataset_base_path: str = _f("", "Folder of the dataset files; for sft:train / direct_distill:train, the cache folder (or its s3://bucket/prefix URL).", "dataset")
    dataset_metadata_path: Optional[str] = _f(None, "Metadata file (csv, json or jsonl), one row per sample.", "dataset")
    dataset_repeat: int = _f(1, "Times each sample is seen per epoch (ignored by data_process).", "dataset")
    dataset_config: Optional[str] = _f(None, "A TOML or JSON file of several datasets, each with its own base_path, metadata, repeats or sampling weight, and optionally max_pixels, height/width, data_file_keys and num_frames (docs/user-guide.md, 'Several datasets'), in place of --dataset_base_path, --dataset_metadata_path and --dataset_repeat. With :train (whose --dataset_base_path is the cache) it is optional and sets the datasets' repeats or weights (default: those stage 1 was given).", "dataset")
    dataset_num_workers: int = _f(0, "Stage 2: DataLoader worker processes that read cache entries and run the model-free train units; stage 1: threads that read and decode the samples' image and video files ahead of the encoders (0: in the main process).", "dataset")
    data_file_keys: str = _f("image", "Comma-separated metadata columns that name files to load.", "dataset")
    extra_inputs: Optional[str] = _f(None, "Comma-separated metadata columns handed to the pipeline (e.g. edit_image).", "dataset")
    # models
    pipeline: Optional[str] = _f(None, "Pipeline to train (see 'unitgraph pipelines'; diffsynth:MODULE trains DiffSynth-Studio's own pipeline of that module, docs/diffsynth.md). Default: the one the command names: its model ids, the classes of its --model_paths folders (model_index.json, a component's config.json), a release file's layout, and the metadata's columns and --extra_inputs (in stage 2, the pipeline its cache was made for) as the tie-breaker; else the first registered family. The run prints its choice and why first.", "models")
    model_paths: Optional[str] = _f(None, "A JSON list of model folders, or one path (a diffusers pipeline folder works).", "models")
    model_id_with_origin_paths: Optional[str] = _f(None, "'org/name:sub/pattern,...' resolved through modelscope.", "models")
    tokenizer_path: Optional[str] = _f(None, "Tokenizer folder of the (first) text encoder (default: beside the text encoder or in the pipeline folder).", "models")
    tokenizer_1_path: Optional[str] = _f(None, "The first text encoder's tokenizer (DiffSynth's name for --tokenizer_path in two-encoder families).", "models")
    tokenizer_2_path: Optional[str] = _f(None, "The second text encoder's tokenizer (two-encoder families; default: beside it or in the pipeline folder).", "models")
    processor_path: Optional[str] = _f(None, "Processor folder for a pipeline whose text encoder reads images (the edit pipelines; default: in the pipeline folder or beside the text encoder, else the family's model id); for --pipeline diffsynth:lingbot_video, its Qwen3-VL processor (a folder, or MODEL_ID:PATTERN as its example gives it; default: Qwen/Qwen3-VL-4B-Instruct:).", "models")
    modelscope_cache_dir: Optional[str] = _f(None, "modelscope cache folder (default: modelscope's own).", "models")
    offload_models: Optional[str] = _f(None, "Accepted for compatibility (no effect: each stage loads only its models).", "models")
    fp8_models: Optional[str] = _f(None, "Frozen models whose weights are stored in float8_e4m3fn and computed layer by layer in the compute dtype (norms, embeddings and LoRA adapters stay): slot names (dit,text_encoder) or, as DiffSynth takes them, the same model paths or ids as --model_paths / --model_id_with_origin_paths. A model whose own weights train cannot be fp8. A DiffSynth pipeline (diffsynth:MODULE) stores them as DiffSynth's train.py does: every weight in fp8, each layer computed in bf16 (docs/diffsynth.md).", "models")
    expert: Optional[str] = _f(None, "The expert of a two-expert DiT to train (high_noise: the pipeline folder's transformer/, low_noise: its transformer_2/); it trains on its own timesteps unless the boundaries narrow them further. Default: the expert the model paths name (transformer_2/, DiffSynth's low_noise_model/), else the one whose timesteps --min/max_timestep_boundary select.", "models")
    # training
    learning_rate: float = _f(1e-4, "The optimizer's learning rate.", "training")
    weight_decay: float = _f(0.01, "The optimizer's weight decay.", "training")
    optimizer: str = _f("adamw", "adamw (torch's AdamW, the default), adamw8bit (bitsandbytes' AdamW8bit, CUDA only), adafactor (transformers' Adafactor, relative_step/scale_parameter/warmup_init false), prodigy (prodigyopt's Prodigy: give --learning_rate 1), came (came_pytorch's CAME) or schedulefree (schedulefree's AdamWScheduleFree: checkpoints and samples hold its averaged weights). Each resumes exactly (docs/objective.md, 'Optimizers').", "training")
    optimizer_args: Optional[str] = _f(None, "The optimizer's own arguments, key=value,key=value: a JSON literal (1e-3, true, null) or a string each, a sequence with colons (betas=0.9:0.999); checked against its constructor. The rate and the decay are --learning_rate and --weight_decay.", "training")
    ema_decay: Optional[float] = _f(None, "Keep an exponential moving average of the trained weights with this decay (0 < D < 1; diffusers' EMAModel schedule: min(D, (n+1)/(n+10)) at step n+1), updated after every optimizer step, saved in the training state and beside each checkpoint as <checkpoint>-ema.safetensors.", "training")
    ema_device: Optional[str] = _f(None, "Where the moving average is kept: cpu (default: the training device).", "training")
    num_epochs: int = _f(1, "Number of epochs.", "training")
    trainable_models: Optional[str] = _f(None, "Comma-separated models trained in full (e.g. dit, text_encoder).", "training")
    gradient_accumulation_steps: int = _f(1, "Micro-steps per optimizer step.", "training")
    find_unused_parameters: bool = _f(False, "DDP find_unused_parameters.", "training")
    use_gradient_checkpointing: bool = _f(False, "Gradient checkpointing in the trained models: activations are recomputed in the backward pass instead of kept.", "training")
    use_gradient_checkpointing_offload: bool = _f(False, "Gradient checkpointing, with the activations it keeps held in CPU memory (torch's save_on_cpu), as DiffSynth does.", "training")
    mixed_precision: Optional[str] = _f(None, "no, fp16 or bf16 (accelerate's name): the dtype frozen weights are held and computed in; trained parameters stay fp32 under autocast. Default: accelerate's launch flag or config (ACCELERATE_MIXED_PRECISION), else bf16 as DiffSynth trains where the device has bf16 kernels (CUDA, a CPU with AVX-512 BF16 or AMX), else no (torch emulates bf16 tens of times slower without them).", "training")
    blocks_to_swap: int = _f(0, "Keep this many transformer blocks of the LoRA base model in CPU memory and bring each to the accelerator ahead of use (no effect without an accelerator).", "training")
    max_grad_norm: Optional[float] = _f(None, "Clip the global norm of the trained parameters' gradients to this before each optimizer step (off by default, as in DiffSynth; under DeepSpeed it is the engine's gradient_clipping, which a config's \"auto\" takes from here). The norm before clipping is logged in loss.csv's grad_norm column.", "training")
    initialize_model_on_cpu: bool = _f(False, "Accepted for DiffSynth's commands (no effect: unitgraph always loads weights in CPU memory and places them after; under ZeRO-3 or FSDP2 each process keeps only its shard).", "training")
    enable_model_cpu_offload: bool = _f(False, "DiffSynth's layer offload: refused with what unitgraph does instead (--blocks_to_swap for a frozen LoRA base on a GPU, ZeRO-3 or FSDP2 parameter offload through the accelerate config).", "training")
    enable_optimizer_cpu_offload: bool = _f(False, "DiffSynth's optimizer offload: refused with what unitgraph does instead (offload_optimizer_device: cpu in a DeepSpeed accelerate config).", "training")
    cpu_offload_split_threshold: Optional[int] = _f(None, "Goes with DiffSynth's --enable_model_cpu_offload (refused with it).", "training")
    task: str = _f("sft", "sft, sft:data_process, sft:train, sft:split, direct_distill[:data_process|:train|:split].", "training")
    max_timestep_boundary: float = _f(1.0, "End of the sampled range of the training schedule, as a fraction of its positions from the noisiest (DiffSynth's meaning: with a shift-5 schedule 0.358 keeps sigmas 1 to ~0.9, a high-noise expert's range).", "training")
    min_timestep_boundary: float = _f(0.0, "Start of the sampled range, as a fraction of the schedule's positions from the noisiest.", "training")
    loss_weighting: str = _f("diffsynth", "The former name of --weighting_scheme (same values).", "training")
    weighting_scheme: Optional[str] = _f(None, "Flow-matching loss weight per timestep: diffsynth (the default: DiffSynth-Studio's training weight, a bell curve over the schedule with mean 1), none (plain MSE), or diffusers' compute_loss_weighting_for_sd3 at the drawn sigma: sigma_sqrt (1/sigma^2), cosmap. The DDPM families weigh by --snr_gamma instead.", "training")
    caption_dropout: float = _f(0.0, "Probability that a step trains a sample on the empty prompt instead of its caption, drawn per sample and epoch from the run's seeded stream. Stage 1 encodes the empty prompt once and stores it beside the cache (a DiffSynth pipeline: per sample, in its entry), so stage 2 still loads no text encoder; with a trained text encoder the empty prompt is encoded live.", "training")
    masked_loss: bool = _f(False, "Weigh each latent position's loss by the sample's mask: the metadata's mask column names an image of the target's size per sample (white counts, grey partly). Stage 1 resizes it as the image and caches its coverage of each latent cell.", "training")
    masked_loss_unmasked_weight: float = _f(0.0, "With --masked_loss, the loss weight of what the mask leaves out (black), 0 to 1; 1 trains as without a mask.", "training")
    timestep_sampling: str = _f("diffsynth", "How a step's timestep is drawn from the positions the boundaries leave: diffsynth (uniform over the schedule's positions, as DiffSynth), or a density of diffusers' compute_density_for_timestep_sampling: uniform, logit_normal (--logit_mean, --logit_std), mode (--mode_scale).", "training")
    logit_mean: float = _f(0.0, "Mean of --timestep_sampling logit_normal.", "training")
    logit_std: float = _f(1.0, "Standard deviation of --timestep_sampling logit_normal.", "training")
    mode_scale: float = _f(1.29, "Scale of --timestep_sampling mode.", "training")
    snr_gamma: Optional[float] = _f(None, "Min-SNR weighting (gamma, 5.0 is the paper's) for the families trained with a DDPM objective (the UNet families): each sample's MSE times min(SNR, gamma)/SNR, as diffusers' examples do (diffusers' compute_snr).", "training")
    vae_latents: Optional[str] = _f(None, "The latent a step trains on: mean (the VAE posterior's mean, computed once in stage 1) or sample (a fresh draw of the posterior each epoch; the cache then keeps the posterior's mean and log-variance). Default: what DiffSynth-Studio trains the pipeline on, as it declares (the mean for the flow-matching families, a sample for the UNet families).", "training")
    lr_scheduler: str = _f("diffsynth", "Learning-rate schedule: diffsynth (as DiffSynth-Studio trains: torch's ConstantLR defaults, the first 5 steps at a third of --learning_rate), or one of diffusers' get_scheduler schedules: constant, constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial (over the run's optimizer steps).", "training")
    lr_warmup_steps: int = _f(0, "Optimizer steps of linear warm-up for the schedules that have one (constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial).", "training")
    # output
    output_path: str = _f("./models", "Output folder (plan.json, training_args.json, loss.csv, checkpoints); for :data_process, the cache folder (or an s3://bucket/prefix URL).", "output")
    remove_prefix_in_ckpt: Optional[str] = _f(None, "Strip this prefix from checkpoint keys (diffusers format: keys are 'transformer.…'; diffsynth format: 'pipe.dit.…', so DiffSynth's 'pipe.dit.' leaves the model's own module names).", "output")
    align_to_opensource_format: bool = _f(False, "DiffSynth's flag for a LoRA file other tools load: selects --lora_format comfyui (the release checkpoint's module names, as ComfyUI loads them). A LoKr or LoHa stays in LyCORIS' layout.", "output")
    lora_format: str = _f("diffusers", "Checkpoint key layout: diffusers (a diffusers pipeline's load_lora_weights reads it), diffsynth (DiffSynth-Studio's pipe.load_lora reads it) or comfyui (the denoiser's LoRA in its release checkpoint's module names, diffusion_model.<module>.lora_up/lora_down/alpha, as ComfyUI loads it; a fused module such as a q/k/v projection gets one exact LoRA of the parts' summed rank); 'unitgraph lora convert' turns one into another. A LoKr or LoHa (--lora_type) is written in LyCORIS' layout whatever the format, and diffsynth is refused for it; a DoRA is refused in diffsynth and comfyui.", "output")
    save_steps: Optional[int] = _f(None, "Also save step-N.safetensors every N optimizer steps.", "output")
    resume: Optional[str] = _f(None, "Continue a killed or finished run exactly: from the newest training state in --output_path (--resume alone), or from a state folder (--resume OUTPUT/state/step-N). A state is written at every checkpoint.", "output")
    validation_prompt: Optional[list[str]] = _f(None, "Render this prompt (repeatable) at each checkpoint through the family's diffusers pipeline with the current weights: OUTPUT/samples/<checkpoint>/, a contact sheet per checkpoint and OUTPUT/samples.html. In split training stage 1 encodes the prompts.", "output")
    validation_steps: Optional[int] = _f(None, "Render the validation prompts every N optimizer steps (default: at each checkpoint).", "output")
    validation_dataset: Optional[str] = _f(None, "A metadata file (csv, json or jsonl) of held-out samples, its file columns relative to its own folder: stage 1 caches them apart from the training samples, and stage 2 logs the trained model's loss on them (seeded fixed timesteps and noise, no gradient) every --validation_steps optimizer steps (default: at each epoch's end) to OUTPUT/validation_loss.csv, the trackers and loss.png. Split training only (:split, or :data_process then :train: stage 2 takes them from the cache).", "output")
    validation_inference_steps: int = _f(20, "Denoising steps of a validation sample.", "output")
    validation_use_ema: bool = _f(False, "Render the validation samples with the moving average of the weights (--ema_decay) instead of the trained weights.", "output")
    validation_guidance: Optional[float] = _f(None, "Guidance scale of the validation samples (default: the pipeline's own sampler default, as its diffusers pipeline's __call__ has it: classifier-free guidance, or the scale embedded in a guidance-distilled DiT; docs/user-guide.md has each pipeline's).", "output")
    validation_negative_prompt: Optional[list[str]] = _f(None, "Negative prompt of the validation samples' classifier-free guidance: once for every --validation_prompt, or repeated once per prompt in their order (default: the empty prompt). Stage 1 encodes it beside the prompts.", "output")
    validation_seed: Optional[int] = _f(None, "Seed of the validation samples (default: --seed); prompt k draws from seed * 1000 + k.", "output")
    validation_image: Optional[list[str]] = _f(None, "Input image of a validation sample, repeated once per --validation_prompt in their order: the image an edit pipeline edits, or the first frame an image-to-video pipeline starts from (those that render with one: docs/user-guide.md, 'Validation samples'), encoded by the pipeline at render time.", "output")
    report_to: str = _f("none", "Also log loss, learning rate and step time to tensorboard or wandb (through accelerate; OUTPUT/logs), or none.", "output")
    save_total_limit: Optional[int] = _f(1, "Keep only the newest K training states under OUTPUT/state (default 1: --resume needs only the newest, and a full fine-tune's state holds the model and its optimizer; 0 keeps every state). The checkpoints themselves are all kept.", "output")
    overwrite: bool = _f(False, "Start anew in an --output_path that holds an earlier run: its files are moved aside into OUTPUT/replaced-<time>/ (nothing is deleted; a cache in it is kept and reused).", "output")
    # LoRA
    lora_base_model: Optional[str] = _f(None, "Model that gets LoRA adapters (a model of the pipeline: dit, text_encoder, ...).", "lora")
    lora_target_modules: Optional[str] = _f(None, "Comma-separated module names for LoRA (default: the family's targets for the LoRA base model, as DiffSynth's examples use).", "lora")
    lora_rank: int = _f(32, "LoRA rank.", "lora")
    lora_alpha: Optional[float] = _f(None, "LoRA alpha (default: the rank, as DiffSynth).", "lora")
    lora_type: str = _f("lora", "The adapter peft trains on the LoRA targets, rank and alpha: lora; dora (weight-decomposed: a magnitude per output beside the LoRA, which diffusers' load_lora_weights reads); lokr (peft's LoKr: the Kronecker product of two factors, the larger one rank-decomposed) or loha (peft's LoHa: the Hadamard product of two rank-r products), both written in LyCORIS' layout (lycoris_<module>.lokr_w1 ..., lora_unet_ for a UNet), which lycoris-lora and ComfyUI load (docs/objective.md, 'LoRA variants').", "lora")
    use_rslora: bool = _f(False, "Rank-stabilised LoRA: scale the adapter by alpha / sqrt(rank) instead of alpha / rank (peft's use_rslora, kept in the file's metadata for diffusers).", "lora")
    lora_checkpoint: Optional[str] = _f(None, "Resume LoRA weights from this safetensors file (a LoKr's or LoHa's in LyCORIS' layout for --lora_type lokr or loha).", "lora")
    preset_lora_path: Optional[str] = _f(None, "A LoRA merged into --preset_lora_model before training (a LoKr or LoHa in LyCORIS' layout too).", "lora")
    preset_lora_model: Optional[str] = _f(None, "Model the preset LoRA is merged into (default: the LoRA base model).", "lora")
    # image size
    height: Optional[int] = _f(None, "Fixed image height (with --width); sides become multiples of 16.", "image")
    width: Optional[int] = _f(None, "Fixed image width (with --height).", "image")
    max_pixels: int = _f(1024 * 1024, "Images larger than this many pixels are scaled down.", "image")
    num_frames: int = _f(81, "Frames per video clip (4k+1): the first frames of each video; a shorter video gives the largest 4k+1 it holds.", "image")
    # DiffSynth's flags that unitgraph honours differently, notes or refuses (DIFFSYNTH_FLAGS says which and why)
    resume_from_checkpoint: Optional[str] = _f(None, "DiffSynth's: a LoRA file to start from is read as --lora_checkpoint; a killed run continues exactly with --resume.", "diffsynth")
    enable_tensorboard_log: bool = _f(False, "DiffSynth's: the same as --report_to tensorboard.", "diffsynth")
    enable_wandb_log: bool = _f(False, "DiffSynth's: the same as --report_to wandb.", "diffsynth")
    wandb_project: Optional[str] = _f(None, "DiffSynth's: the wandb project of --report_to wandb (default: <pipeline>-<task>).", "diffsynth")
    enable_csv_log: bool = _f(False, "DiffSynth's: no effect (unitgraph always writes loss.csv and loss.png).", "diffsynth")
    enable_swanlab_log: bool = _f(False, "DiffSynth's: refused (SwanLab is not a tracker accelerate knows; --report_to tensorboard or wandb).", "diffsynth")
    swanlab_project: Optional[str] = _f(None, "DiffSynth's: refused with --enable_swanlab_log.", "diffsynth")
    customized_optimizer: Optional[str] = _f(None, "DiffSynth's: refused (no class named on the command line is imported; --optimizer chooses one).", "diffsynth")
    quant_options: Optional[str] = _f(None, "DiffSynth's: refused (frozen models are stored in fp8 with --fp8_models).", "diffsynth")
    template_model_id_or_path: Optional[str] = _f(None, "DiffSynth's: refused (its template models are not trained by unitgraph).", "diffsynth")
    enable_lora_hot_loading: bool = _f(False, "DiffSynth's: refused (for its image-to-LoRA models, not trained by unitgraph).", "diffsynth")
    enable_npu_patch: bool = _f(False, "DiffSynth's: no effect (an Ascend NPU kernel patch; unitgraph runs torch's own kernels).", "diffsynth")
    frame_rate: Optional[float] = _f(None, "DiffSynth's frame rate of clips with sound (LTX-2, MOVA): unitgraph trains them at 24 fps, DiffSynth's default (another rate is refused).", "diffsynth")
    zero_cond_t: bool = _f(False, "DiffSynth's Qwen-Image-Edit-2511 flag: refused (that release is not trained by unitgraph).", "diffsynth")
    audio_processor_path: Optional[str] = _f(None, "DiffSynth's speech-to-video (S2V) flag: refused (not trained by unitgraph).", "diffsynth")
    framewise_decoding: bool = _f(False, "DiffSynth's dance-video (ToDance) flag: refused (not trained by unitgraph).", "diffsynth")
    first_frame_as_condition: bool = _f(False, "DiffSynth's LingBot-Video flag: refused (not trained by unitgraph).", "diffsynth")
    max_audio_duration: Optional[float] = _f(None, "DiffSynth's ACE-Step flag (--pipeline diffsynth:ace_step): the seconds of each song trained, its beginning (default: the whole song, at most 600 s).", "diffsynth")
    silence_latent_path: Optional[str] = _f(None, "DiffSynth's ACE-Step flag (--pipeline diffsynth:ace_step): the silence latent, a file or MODEL_ID:PATTERN (default: ACE-Step/Ace-Step1.5:acestep-v15-turbo/silence_latent.pt), read from its .safetensors twin beside it.", "diffsynth")
    silent_on_missing_audio: bool = _f(False, "DiffSynth's MiniMax-H3 flag: refused (not trained by unitgraph).", "diffsynth")
    noise_scale: Optional[float] = _f(None, "DiffSynth's HiDream-O1-Image flag (--pipeline diffsynth:hidream_o1_image): the scale of the noise the loss draws (default: 8.0, its train.py's), stored in stage 1's cache.", "diffsynth")
    processor_config: Optional[str] = _f(None, "DiffSynth's HiDream-O1-Image flag (--pipeline diffsynth:hidream_o1_image): its Qwen3-VL processor, a folder or MODEL_ID:PATTERN as its example gives it (default: HiDream-ai/HiDream-O1-Image-Dev:./, the release's root).", "diffsynth")
    tokenizer_t5xxl_path: Optional[str] = _f(None, "DiffSynth's Anima flag: the T5 tokenizer of --pipeline diffsynth:anima_image (a folder, or MODEL_ID:PATTERN as its example gives it; default: stabilityai/stable-diffusion-3.5-large:tokenizer_3/).", "diffsynth")
    dmd2_student_update_freq: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_student_sample_steps: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_student_sample_type: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_student_schedule: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_student_t_list: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_matching_t_min: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_matching_t_max: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_matching_t_sampling: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_matching_t_mean: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_matching_t_std: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_gan_loss_weight: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_gan_r1_reg_weight: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_gan_r1_reg_alpha: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_fake_score_learning_rate: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_discriminator_learning_rate: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_feature_indices: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_teacher_cfg_scale: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    dmd2_student_grad_clip_norm: Optional[str] = _f(None, "DiffSynth's DMD2 setting: refused (DMD2 distillation is not trained by unitgraph).", "diffsynth")
    # unitgraph
    seed: int = _f(0, "Seed of every random draw (shuffle, latents, noise, timesteps, LoRA init).", "unitgraph")
    cache_path: Optional[str] = _f(None, "Cache folder or s3://bucket/prefix URL for :split (default OUTPUT/cache) and :data_process (default OUTPUT).", "unitgraph")
    cache_layout: str = _f("files", "files (one object per entry) or shards (many entries per object, per process: for caches of millions of samples on an object store).", "unitgraph")
    cache_mode: str = _f("latest", "latest or versioned (see docs/semantics.md, section 'Cache mode versioned').", "unitgraph")
    batch_size: int = _f(1, "Samples per micro-step in stage 2 (:train, :split): cached samples of equal shapes batched together; unsplit sft takes 1.", "unitgraph")
    data_process_batch_size: Optional[int] = _f(None, "Samples per model call in stage 1: samples of equal shapes go through the VAE and text encoders together (entries stay per sample; the VAE's batched kernels round differently, by a few 1e-6 at most here, so split training then matches unsplit within that, not bit for bit). Default: the family's (1).", "unitgraph")
    cache_dtype: Optional[str] = _f(None, "bf16, fp16 or fp32: dtype of the floating tensors stage 1 stores (default: the dtype the model computes in); stage 2 casts them back.", "unitgraph")
    config_file: Optional[str] = _f(None, "With --dry_run: the accelerate config the run will be launched with (accelerate launch --config_file), so the memory plan is per process under its engine (DeepSpeed ZeRO, FSDP2 or data parallel). A run itself takes its engine from accelerate launch.", "unitgraph")
    num_processes: Optional[int] = _f(None, "With --dry_run: the processes the run will be launched with (accelerate launch --num_processes; default: the config's, else 1).", "unitgraph")
    dry_run: bool = _f(False, "Print the memory plan (weights at their storage dtype, trainable state, activations, peak) of stage 1, stage 2 and the unsplit run from the config files alone, then stop; writes nothing.", "unitgraph")
    json: bool = _f(False, "With --dry_run: print the memory plan as one JSON object.", "unitgraph")
    plot: bool = _f(True, "Write loss.png at the end.", "unitgraph")
    progress: bool = _f(True, "Show progress bars.", "unitgraph")

    # ------------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.task.split(":", 1)[0]

    @property
    def stage(self) -> str:
        """'' (unsplit), 'data_process', 'train' or 'split'."""
        return self.task.split(":", 1)[1] if ":" in self.task else ""

    def trainable(self) -> list[str]:
        return split_list(self.trainable_models)

    def _diffsynth_flags(self) -> None:
        """DiffSynth's flags that unitgraph takes its own way (the "diffsynth" group): the ones it honours become
        unitgraph's flags, the ones it cannot honour are refused in one line saying what it does instead (the
        others are noted at the start of a run: `diffsynth_notes`)."""
        given = [f.name for f in fields(self) if f.metadata.get("group") == "diffsynth"
                 and getattr(self, f.name) not in (None, False)]
        dmd2 = [name for name in given if name.startswith("dmd2_")]
        if dmd2:
            raise BackendError(f"--{dmd2[0]}: DMD2 distillation is DiffSynth's task, which unitgraph does not train; "
                               "it trains sft and direct_distill")
        for name in given:
            if name in REFUSED_DIFFSYNTH_FLAGS:
                raise BackendError(f"--{name}: {REFUSED_DIFFSYNTH_FLAGS[name]}")
        if self.frame_rate is not None and float(self.frame_rate) != 24.0:
            raise BackendError(f"--frame_rate {self.frame_rate}: unitgraph trains clips with sound at 24 fps (DiffSynth's "
                               "default, and diffusers' LTX-2 pipeline's)")
        logs = [kind for kind, on in (("tensorboard", self.enable_tensorboard_log), ("wandb", self.enable_wandb_log)) if on]
        if len(logs) > 1 or (logs and self.report_to not in ("none", logs[0])):
            shown = " and ".join([*(f"--enable_{k}_log" for k in logs), *([f"--report_to {self.report_to}"]
                                                                          if self.report_to != "none" else [])])
            raise BackendError(f"{shown} ask for different trackers; unitgraph reports to one (--report_to)")
        if logs:
            self.report_to = logs[0]
        if self.wandb_project is not None and self.report_to != "wandb":
            raise BackendError("--wandb_project names the project of --report_to wandb (or --enable_wandb_log)")
        if self.resume_from_checkpoint is not None:
            if not self.lora_base_model or (self.lora_checkpoint and self.lora_checkpoint != self.resume_from_checkpoint):
                raise BackendError("--resume_from_checkpoint: unitgraph starts a LoRA from a file with --lora_checkpoint "
                                   "(which this flag sets with --lora_base_model) and continues a killed or finished "
                                   "run exactly with --resume; a full model starts from its --model_paths")
            self.lora_checkpoint = self.resume_from_checkpoint

    def diffsynth_notes(self) -> list[str]:
        """One line for each DiffSynth flag given that has no effect here, or that was read as unitgraph's own."""
        notes = []
        if self.enable_csv_log:
            notes.append("note: --enable_csv_log has no effect: unitgraph always writes loss.csv (and loss.png)")
        if self.enable_npu_patch:
            notes.append("note: --enable_npu_patch has no effect: it patches Ascend NPU kernels; unitgraph runs "
                         "torch's own")
        if self.frame_rate is not None:
            notes.append("note: --frame_rate 24 is the rate unitgraph trains clips with sound at (no other is taken)")
        if self.enable_tensorboard_log or self.enable_wandb_log:
            notes.append(f"note: --enable_{self.report_to}_log is read as --report_to {self.report_to}")
        if self.resume_from_checkpoint is not None:
            notes.append(f"note: --resume_from_checkpoint is read as --lora_checkpoint {self.resume_from_checkpoint} "
                         "(the LoRA starts from that file; --resume continues a run exactly)")
        return notes

    def extra_input_names(self) -> list[str]:
        return split_list(self.extra_inputs)

    def sampling(self) -> TimestepSampling:
        """--timestep_sampling and its parameters."""
        return TimestepSampling(self.timestep_sampling, float(self.logit_mean), float(self.logit_std),
                                float(self.mode_scale))

    def file_keys(self) -> list[str]:
        return split_list(self.data_file_keys)

    def output_format(self) -> str:
        """The layout checkpoints are written in: --lora_format, or comfyui where --align_to_opensource_format asks for
        the layout other tools load (DiffSynth's flag) and --lora_format is left at its default."""
        return "comfyui" if self.align_to_opensource_format and self.lora_format == "diffusers" else self.lora_format

    def lora_targets(self) -> list[str]:
        return split_list(self.lora_target_modules)

    def first_tokenizer_path(self) -> Optional[str]:
        """--tokenizer_path or its two-encoder spelling --tokenizer_1_path (checked in validate: not two different ones)."""
        return self.tokenizer_1_path or self.tokenizer_path

    def validate(self) -> "TrainArgs":
        if self.task.partition(":")[0] in OTHER_TASKS:
            raise BackendError(f"--task {self.task}: {OTHER_TASKS[self.task.partition(':')[0]]} is DiffSynth's task, "
                               f"which unitgraph does not train; it trains sft and direct_distill (each also as "
                               ":data_process, :train and :split)")
        if self.task not in TASKS:
            raise BackendError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        self._diffsynth_flags()
        if self.lora_format not in LORA_FORMATS:
            raise BackendError(f"--lora_format must be one of {', '.join(LORA_FORMATS)}, got {self.lora_format!r}")
        if self.num_frames < 1 or (self.num_frames - 1) % 4:
            raise BackendError(f"--num_frames must be 4k+1 (1, 5, 9, ..., 81), got {self.num_frames}")
        if self.num_frames > MAX_FRAMES:
            raise BackendError(f"--num_frames {self.num_frames}: at most {MAX_FRAMES} frames a clip (8 times the longest "
                               "clips the released video models train on, 121)")
        if self.tokenizer_path and self.tokenizer_1_path and self.tokenizer_path != self.tokenizer_1_path:
            raise BackendError("--tokenizer_path and --tokenizer_1_path name the same tokenizer (the first text "
                               "encoder's); give one of them")
        if self.validation_prompt is not None:
            if isinstance(self.validation_prompt, str):
                self.validation_prompt = [self.validation_prompt]
            self.validation_prompt = [str(p) for p in self.validation_prompt] or None
        for name in ("validation_negative_prompt", "validation_image"):  # repeatable, as --validation_prompt
            given = getattr(self, name)
            if given is not None:
                setattr(self, name, [str(p) for p in ([given] if isinstance(given, str) else given)] or None)
        self._check_validation_flags()
        if self.validation_dataset and self.stage == "":
            raise BackendError(f"--validation_dataset: the held-out loss is computed from stage 1's cache entries; train "
                               f"with --task {self.family}:split (or :data_process, then :train)")
        if self.validation_steps is not None and self.validation_steps < 1:
            raise BackendError(f"--validation_steps must be at least 1, got {self.validation_steps}")
        if not 1 <= self.validation_inference_steps <= MAX_VALIDATION_INFERENCE_STEPS:
            raise BackendError(f"--validation_inference_steps must be between 1 and {MAX_VALIDATION_INFERENCE_STEPS}, "
                               f"got {self.validation_inference_steps}")
        if self.report_to not in REPORT_TO:
            raise BackendError(f"--report_to must be one of {', '.join(REPORT_TO)}, got {self.report_to!r}")
        if self.report_to != "none":
            import importlib.util

            needed = {"tensorboard": "tensorboard", "wandb": "wandb"}[self.report_to]
            if importlib.util.find_spec(needed) is None:
                raise BackendError(f"--report_to {self.report_to} needs the {needed} package (pip install {needed})")
        if self.weighting_scheme is not None:
            if self.loss_weighting not in ("diffsynth", self.weighting_scheme):
                raise BackendError(f"--weighting_scheme {self.weighting_scheme} and --loss_weighting {self.loss_weighting} "
                                   "disagree (--loss_weighting is its former name): give one of them")
            self.loss_weighting = self.weighting_scheme
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise BackendError(f"--weighting_scheme must be one of {', '.join(LOSS_WEIGHTINGS)}, got {self.loss_weighting!r}")
        check_caption_dropout(self.caption_dropout)
        check_unmasked_weight(self.masked_loss_unmasked_weight)
        if self.masked_loss_unmasked_weight and not self.masked_loss:
            raise BackendError("--masked_loss_unmasked_weight has no effect without --masked_loss")
        problem = self.sampling().problem()
        if problem:
            raise BackendError(problem)
        if self.snr_gamma is not None and not (math.isfinite(self.snr_gamma) and self.snr_gamma > 0):
            raise BackendError(f"--snr_gamma must be a number above 0 (5.0 is Min-SNR's), got {self.snr_gamma}")
        if self.vae_latents is not None and self.vae_latents not in VAE_LATENTS:
            raise BackendError(f"--vae_latents must be one of {', '.join(VAE_LATENTS)}, got {self.vae_latents!r}")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise BackendError(f"--lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {self.lr_scheduler!r}")
        if self.lr_warmup_steps < 0:
            raise BackendError(f"--lr_warmup_steps must be 0 or more, got {self.lr_warmup_steps}")
        if self.lr_warmup_steps and self.lr_scheduler in ("diffsynth", "constant"):
            raise BackendError(f"--lr_warmup_steps needs a schedule with a warm-up (--lr_scheduler constant_with_warmup, "
                               f"linear, cosine, ...); {self.lr_scheduler} has none")
        if self.save_total_limit is not None and self.save_total_limit < 0:
            raise BackendError(f"--save_total_limit must be 0 (keep every state) or more, got {self.save_total_limit}")
        if self.resume is not None and self.overwrite:
            raise BackendError("--resume continues the run in --output_path and --overwrite moves it aside: give one of them")
        if self.resume is not None and self.stage == "data_process":
            raise BackendError("--resume continues training; stage 1 (:data_process) resumes by itself")
        if self.cache_mode not in ("latest", "versioned"):
            raise BackendError(f"--cache_mode must be latest or versioned, got {self.cache_mode!r}")
        for name in ("num_epochs", "gradient_accumulation_steps", "dataset_repeat", "lora_rank", "max_pixels"):
            if getattr(self, name) < 1:
                raise BackendError(f"--{name} must be at least 1, got {getattr(self, name)}")
        self._check_dataset_config()
        if self.save_steps is not None and self.save_steps < 1:
            raise BackendError(f"--save_steps must be at least 1, got {self.save_steps}")
        if self.batch_size < 1:
            raise BackendError(f"--batch_size must be at least 1, got {self.batch_size}")
        if self.batch_size > 1 and self.stage == "":
            raise BackendError(f"--batch_size {self.batch_size} needs stage 2 (--task {self.family}:split or {self.family}:train); "
                               "unsplit training takes one sample per micro-step (use --gradient_accumulation_steps)")
        check_seed(self.seed)
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISION:
            raise BackendError(f"--mixed_precision must be one of {', '.join(MIXED_PRECISION)}, got {self.mixed_precision!r}")
        if self.blocks_to_swap < 0:
            raise BackendError(f"--blocks_to_swap must be 0 or more, got {self.blocks_to_swap}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise BackendError(f"--max_grad_norm must be a positive number, got {self.max_grad_norm}")
        if (self.config_file is not None or self.num_processes is not None) and not self.dry_run:
            raise BackendError("--config_file and --num_processes go with --dry_run; a run takes them from accelerate "
                               "launch: accelerate launch --config_file X --num_processes N unitgraph train ...")
        if self.num_processes is not None and self.num_processes < 1:
            raise BackendError(f"--num_processes must be at least 1, got {self.num_processes}")
        if self.enable_model_cpu_offload or self.cpu_offload_split_threshold is not None:
            raise BackendError("--enable_model_cpu_offload (DiffSynth's layer offload) is not how unitgraph offloads: "
                               "--blocks_to_swap N keeps N blocks of a frozen LoRA base in CPU memory on a GPU, and an "
                               "accelerate config with ZeRO-3 offload_param_device: cpu or FSDP2 fsdp_offload_params: "
                               "true keeps every weight's shard there (docs/user-guide.md, 'Several GPUs')")
        if self.enable_optimizer_cpu_offload:
            raise BackendError("--enable_optimizer_cpu_offload: unitgraph offloads the optimizer through the engine: "
                               "launch with a DeepSpeed accelerate config whose offload_optimizer_device is cpu "
                               "(DiffSynth's accelerate_config_zero2offload.yaml does; docs/user-guide.md, 'Several GPUs')")
        if self.json and not self.dry_run:
            raise BackendError("--json goes with --dry_run (the memory plan as JSON)")
        if self.cache_dtype is not None and self.cache_dtype not in CACHE_DTYPE_FLAGS:
            raise BackendError(f"--cache_dtype must be one of {', '.join(CACHE_DTYPE_FLAGS)}, got {self.cache_dtype!r}")
        if self.data_process_batch_size is not None and self.data_process_batch_size < 1:
            raise BackendError(f"--data_process_batch_size must be at least 1, got {self.data_process_batch_size}")
        if self.cache_layout not in ("files", "shards"):
            raise BackendError(f"--cache_layout must be files or shards, got {self.cache_layout!r}")
        if self.dataset_num_workers < 0:
            raise BackendError(f"--dataset_num_workers must be 0 or more, got {self.dataset_num_workers}")
        if (self.height is None) != (self.width is None):
            raise BackendError("--height and --width go together (or use --max_pixels)")
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value % 16):
                raise BackendError(f"--{name} must be a positive multiple of 16, got {value}")
        limit = image_pixel_limit()
        if self.height is not None and self.width is not None and self.height * self.width > limit:
            raise BackendError(f"--height {self.height} --width {self.width}: {self.height * self.width} pixels, more "
                               f"than the {limit} an image may have (PIL's Image.MAX_IMAGE_PIXELS, the bound the image "
                               "readers keep)")
        if not 0.0 <= self.min_timestep_boundary < self.max_timestep_boundary <= 1.0:
            raise BackendError("timestep boundaries must satisfy 0 <= --min_timestep_boundary < --max_timestep_boundary <= 1")
        if not self.trainable() and not self.lora_base_model and self.stage != "data_process":
            raise BackendError("nothing to train: give --lora_base_model and/or --trainable_models")
        # AdamW refuses these only after the models are loaded; say so before anything starts
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise BackendError(f"--learning_rate must be a positive number, got {self.learning_rate}")
        if self.lr_scheduler == "polynomial" and not self.learning_rate > POLYNOMIAL_LR_END:
            raise BackendError(f"--lr_scheduler polynomial decays to {POLYNOMIAL_LR_END:g} (diffusers' lr_end), so "
                               f"--learning_rate must be larger than that, got {self.learning_rate:g}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise BackendError(f"--weight_decay must be 0 or a positive number, got {self.weight_decay}")
        if self.ema_decay is not None and not (math.isfinite(self.ema_decay) and 0 < self.ema_decay < 1):
            raise BackendError(f"--ema_decay must be a number between 0 and 1 (0.999 is usual), got {self.ema_decay}")
        if self.ema_device is not None and self.ema_device != "cpu":
            raise BackendError(f"--ema_device must be cpu (the default keeps the average on the training device), got "
                               f"{self.ema_device!r}")
        if self.ema_device is not None and self.ema_decay is None:
            raise BackendError("--ema_device places the moving average of --ema_decay: give --ema_decay too")
        if self.validation_use_ema and (self.ema_decay is None or not self.validation_prompt):
            raise BackendError("--validation_use_ema renders the --validation_prompt samples with the moving average of "
                               "--ema_decay: give both")
        from .train.optimizers import check_optimizer  # torch only for an optimizer other than plain AdamW

        check_optimizer(self.optimizer, self.optimizer_args, cuda=None if self.dry_run or self.stage == "data_process"
                        else cuda_available)
        if self.lora_type not in LORA_TYPES:
            raise BackendError(f"--lora_type must be one of {', '.join(LORA_TYPES)}, got {self.lora_type!r}")
        if (self.lora_type != "lora" or self.use_rslora) and not self.lora_base_model:
            raise BackendError(f"--{'lora_type' if self.lora_type != 'lora' else 'use_rslora'} needs --lora_base_model "
                               "(it shapes the LoRA adapter)")
        if self.lora_type == "dora" and self.lora_format == "diffsynth":
            raise BackendError("--lora_type dora with --lora_format diffsynth: DiffSynth-Studio's LoRA layout has no "
                               "DoRA magnitudes; write --lora_format diffusers")
        if self.align_to_opensource_format and self.lora_format == "diffsynth":
            raise BackendError("--align_to_opensource_format with --lora_format diffsynth: the flag selects ComfyUI's "
                               "layout (--lora_format comfyui); drop one of them")
        if self.lora_type == "dora" and self.output_format() == "comfyui":
            flag = "--lora_format comfyui" if self.lora_format == "comfyui" else "--align_to_opensource_format"
            raise BackendError(f"--lora_type dora with {flag}: ComfyUI's dora_scale divides by the base weight's row "
                               "norms where peft's DoRA divides by the adapted weight's, so a DoRA cannot be written "
                               "for it exactly; write --lora_format diffusers")
        if self.lora_type in ("lokr", "loha"):
            name = {"lokr": "LoKr", "loha": "LoHa"}[self.lora_type]
            if self.lora_format == "diffsynth":
                raise BackendError(f"--lora_type {self.lora_type} with --lora_format diffsynth: DiffSynth-Studio's "
                                   f"load_lora fuses lora_A/lora_B pairs only, and a {name} is none; a {name} is "
                                   "written in LyCORIS' layout (drop --lora_format)")
            if self.use_rslora:
                raise BackendError(f"--use_rslora with --lora_type {self.lora_type}: peft's {name} scales by alpha / "
                                   "rank and has no rank-stabilised scale; set --lora_alpha instead")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise BackendError(f"--lora_alpha must be a positive number (default: the rank), got {self.lora_alpha}")
        for name in ("trainable_models", "lora_target_modules", "data_file_keys", "extra_inputs"):
            value = getattr(self, name)
            if value is not None and str(value).strip() and not split_list(value):
                raise BackendError(f"--{name} {value!r} names nothing (a comma-separated list was expected)")
        for name in ("lora_checkpoint", "preset_lora_path"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise BackendError(f"--{name}: no such file", source=path)
        if self.preset_lora_model and not self.preset_lora_path:
            raise BackendError("--preset_lora_model names the model a --preset_lora_path is merged into; give both")
        return self

    def _check_dataset_config(self) -> None:
        """--dataset_config lists the datasets, their folders, metadata and repeats: the flags that say the same of one
        dataset go without it (in :train --dataset_base_path is the cache, and stays)."""
        if not self.dataset_config:
            return
        given = [flag for flag, value in (("--dataset_base_path", self.stage != "train" and self.dataset_base_path),
                                          ("--dataset_metadata_path", self.dataset_metadata_path),
                                          ("--dataset_repeat", self.dataset_repeat != 1)) if value]
        if given:
            raise BackendError(f"--dataset_config lists each dataset's base_path, metadata and repeats: give "
                               f"{', '.join(given)} there instead, not beside it", source=self.dataset_config)

    def _check_validation_flags(self) -> None:
        """The flags that shape the --validation_prompt samples: given with prompts, once or once per prompt."""
        prompts = len(self.validation_prompt or ())
        for name in ("validation_guidance", "validation_negative_prompt", "validation_seed", "validation_image"):
            if getattr(self, name) is not None and not prompts:
                raise BackendError(f"--{name} shapes the --validation_prompt samples: give --validation_prompt too")
        negatives = self.validation_negative_prompt
        if negatives is not None and len(negatives) not in (1, prompts):
            raise BackendError(f"--validation_negative_prompt is given {len(negatives)} times for {prompts} "
                               "--validation_prompt values: give it once (for every prompt) or once per prompt")
        if self.validation_image is not None and len(self.validation_image) != prompts:
            raise BackendError(f"--validation_image is given {len(self.validation_image)} times for {prompts} "
                               "--validation_prompt values: give one image per prompt, in their order")
        if self.validation_seed is not None:
            check_seed(self.validation_seed, "--validation_seed")
        guidance = self.validation_guidance
        if guidance is not None and not (math.isfinite(guidance) and guidance >= 0):
            raise BackendError(f"--validation_guidance must be a number of at least 0, got {guidance}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


def cuda_available() -> bool:
    """Whether the run will have a CUDA device (accelerate's ACCELERATE_USE_CPU keeps it on the CPU)."""
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes", "y", "on"):
        return False
    import torch

    return torch.cuda.is_available()


def check_seed(seed: int, flag: str = "--seed") -> None:
    """Every command's seed (train, tiny-models, demo) in torch's range: its generators take at most 64 bits, and
    renders add the prompt's position."""
    if not 0 <= seed < MAX_SEED:
        raise BackendError(f"{flag} must be between 0 and {MAX_SEED - 1}, got {seed}")


def split_list(text: Optional[str]) -> list[str]:
    if not text:
        return []
    return [part.strip() for part in str(text).split(",") if part.strip()]


def arg_fields() -> list[tuple[str, Any, Any, str]]:
    """(name, type annotation, default, help) of every flag, in declaration order."""
    out = []
    hints = {"int": int, "float": float, "str": str, "bool": bool,
             "Optional[str]": Optional[str], "Optional[int]": Optional[int], "Optional[float]": Optional[float],
             "Optional[list[str]]": Optional[list[str]]}
    for f in fields(TrainArgs):
        default = f.default if f.default is not MISSING else None
        out.append((f.name, hints[f.type] if isinstance(f.type, str) else f.type, default, f.metadata.get("help", "")))
    return out


def unchecked_args(**kwargs: Any) -> TrainArgs:
    """TrainArgs from keyword arguments, with unknown names reported as a BackendError, not yet validated (the CLI
    first names a family unitgraph does not train, whose settings are not unitgraph's to judge)."""
    known = {f.name for f in fields(TrainArgs)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise BackendError(f"unknown training argument {unknown[0]!r}")
    return TrainArgs(**kwargs)


def make_args(**kwargs: Any) -> TrainArgs:
    """TrainArgs from keyword arguments, with unknown names reported as a BackendError, validated."""
    return unchecked_args(**kwargs).validate()
