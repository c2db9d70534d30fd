"""The Python front doors, beside the command line (``cli.py``): ``maxent_grpo.train`` (front/train.py)
and TRL's ``GRPOConfig`` / ``GRPOTrainer`` (front/grpo_config.py, front/grpo_trainer.py). Each turns
Python objects into the same typed plan the CLI compiles (front/objects.py); the run below does not
know which door was used."""
