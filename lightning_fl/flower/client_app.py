"""The server-side mode's ClientApp as a Flower App names it (``recipes/flower_server``:
``clientapp = "lightning_fl.flower.client_app:client_app"``), without torch or Lightning
until a message needs them (issue 77, item 3).

Flower starts a ``flwr-clientapp`` process for every message, and importing torch and
Lightning takes most of that process's life when the message does not train: three of
SecAgg+'s four stages (key setup, share exchange, unmasking) are ``secaggplus_mod``'s
arithmetic alone. The mods and the handlers here import only Flower; the handlers import
:mod:`lightning_fl.flower.server_side` (the recipe, the module, the data) when a message
reaches them.
"""

from __future__ import annotations

from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

#: SecAgg+'s configuration record in a secure round's messages (Flower's
#: ``secaggplus_constants.RECORD_KEY_CONFIGS``, read here without its imports)
SECAGG_RECORD = "secaggplus_configs"


def is_secure(content: Any) -> bool:
    """Whether a ``train`` message's content is a secure round's."""
    return SECAGG_RECORD in content.config_records


def secure_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``secaggplus_mod`` for the ``train`` messages of a secure round (those
    carrying its configuration record), else nothing."""
    if message.metadata.message_type == "train" and is_secure(message.content):
        from flwr.client.mod import secaggplus_mod

        return secaggplus_mod(message, context, call_next)
    return call_next(message, context)


def _dp_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """:func:`lightning_fl.flower.flower_dp.dp_mod` for train messages (a client-side
    wrapper's clipping), imported when one arrives."""
    if message.metadata.message_type != "train":
        return call_next(message, context)
    from lightning_fl.flower.flower_dp import dp_mod

    return dp_mod(message, context, call_next)


def _local_dp_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``LocalDpMod`` where the run config asks for it
    (:func:`lightning_fl.flower.flower_dp.local_dp_mod`)."""
    if message.metadata.message_type != "train":
        return call_next(message, context)
    from lightning_fl.flower.flower_dp import LocalDP, local_dp_mod

    mod = local_dp_mod(lambda ctx: LocalDP.read(ctx.run_config))
    return mod(message, context, call_next)


#: the nodes' ClientApp: it masks its replies when the server runs a secure round, and
#: clips or noises them as the run's DP options say
client_app = ClientApp(mods=[secure_mod, _dp_mod, _local_dp_mod])


@client_app.query()
def _query(message: Message, context: Context) -> Message:
    from lightning_fl.flower import server_side

    return server_side.answer_query(server_side.Settings.read(context.run_config), message,
                                    context)  # fmt: skip


@client_app.train()
def _train(message: Message, context: Context) -> Message:
    from lightning_fl.flower import server_side

    return server_side.train(server_side.Settings.read(context.run_config), message, context)


@client_app.evaluate()
def _evaluate(message: Message, context: Context) -> Message:
    from lightning_fl.flower import server_side

    return server_side.evaluate(server_side.Settings.read(context.run_config), message,
                                context)  # fmt: skip


__all__ = ["client_app", "is_secure", "secure_mod"]
