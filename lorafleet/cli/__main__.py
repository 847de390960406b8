"""`python -m lorafleet.cli …` is `lorafleet …`."""

from lorafleet.cli import main

main()
