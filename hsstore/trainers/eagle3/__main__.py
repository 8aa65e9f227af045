"""``python -m hsstore.trainers.eagle3 --data DS --steps N --out DIR``: see hsstore/trainers/eagle3/train.py."""

from hsstore.trainers.eagle3.train import main

if __name__ == "__main__":
    main()
