"""What several modules share, kept below all of them: it imports nothing of the package, so no two
modules reach into each other for a name (an import circle) and each can be read and tested alone."""

# The files of a Hugging Face safetensors checkpoint: export.py writes them, pretrained.py reads them.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ModelSplitError(ValueError):
    """The model cannot be run layer by layer; the message says what it needs (model_split.py and the
    Hugging Face split, models/hf.py, raise it)."""
