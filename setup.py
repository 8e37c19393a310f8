from setuptools import find_packages, setup

setup(
    name="ds_greedysnake",
    version="0.1.0",
    description="GreedySnake vertical scheduling for SSD-offloaded training, as a DeepSpeed plugin",
    packages=find_packages(include=["ds_greedysnake", "ds_greedysnake.*"]),
    python_requires=">=3.10",
    # DeepSpeed is pinned: deepspeed_compat.py relies on private pieces checked against this release.
    # transformers is pinned: ds_greedysnake/models/hf.py's split was checked against this release.
    # safetensors: Hugging Face checkpoints in (pretrained.py) and out (export.py), a layer at a time, and
    # greedysnake's own checkpoints. torch 2.5: torch.serialization.safe_globals and
    # get_unsafe_globals_in_checkpoint (checkpoint_format.py).
    # accelerate is pinned: GreedySnakeTrainer (hf_trainer.py) relies on how its DeepSpeed preparation
    # calls deepspeed.initialize, checked against this release. Installed with the rest (set-up runs
    # `pip install -e .`), so that `from ds_greedysnake import GreedySnakeTrainer` works everywhere.
    # peft is pinned: model_split.py sees through its PeftModel wrapper and export.py writes adapters through
    # its save_pretrained, checked against this release.
    install_requires=["deepspeed==0.19.8", "torch>=2.5", "numpy", "pytest", "matplotlib", "scipy>=1.10",
                      "transformers==5.24.0", "accelerate==1.15.0", "peft==0.21.2", "tqdm", "safetensors"],
    # trl is pinned, and optional: GreedySnakeSFTTrainer (sft_trainer.py, trl_sft.py) runs SFTTrainer's loss
    # through trl's fused-LM-head kernel and reads its metric lists, checked against this release. The set-up
    # (scripts/setup.sh) installs it, so the suite tests it; it brings datasets, pandas and pyarrow.
    extras_require={"trl": ["trl==1.16.0"]},
)
