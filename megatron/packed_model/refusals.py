"""The one shape of the fork's refusals, ``ValueError("<what> is wrong: <value>. <what to
do>.")``, for the graph modules' config checks (moe_experts.py, moe_dropless.py) and the
parse-time rules (packed_training/extra_args.py): `fail` raises it, `refuse` for a rule list."""


def fail(what: str, value, todo: str):
    """Raise the one error shape every rule uses."""
    raise ValueError(f"{what} is wrong: {value}. {todo}.")


def refuse(*rules, suffix: str = "") -> None:
    """`fail` on the first rule ``(refused, flag, value, todo)`` that holds (todo + suffix)."""
    for refused, flag, value, todo in rules:
        if refused:
            fail(flag, value, todo + suffix)
