"""Hugging Face on the engine: GreedySnakeTrainer, GreedySnakeSFTTrainer (TRL), their losses, accelerate's
prepare. Imports initialize and everything below it; nothing but the package root imports hf/."""
