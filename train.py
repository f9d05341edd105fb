"""python train.py [group=option ...] [key=value ...]   (python train.py --help lists them)

Composes the run from conf/ and hands it to feedrate; returns `objective` to Hydra sweepers.
"""

import hydra
from omegaconf import DictConfig

import feedrate.launch
from feedrate.config import TRUSTED_TARGETS


@hydra.main(config_path="conf", config_name="train", execution_whitelist=TRUSTED_TARGETS)
def main(cfg: DictConfig) -> float:
    return feedrate.launch.main(cfg)


if __name__ == "__main__":
    main()
