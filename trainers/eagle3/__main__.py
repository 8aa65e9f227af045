"""``python -m trainers.eagle3 --data DS --steps N --out DIR``: see trainers/eagle3/train.py."""

from trainers.eagle3.train import main

if __name__ == "__main__":
    main()
