from zerofunc.models.gpt2 import GPT, GPTConfig, MODELS, model_config

__all__ = ["GPT", "GPTConfig", "MODELS", "model_config"]
