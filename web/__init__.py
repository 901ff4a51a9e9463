"""Sluice's HTTP side. A server process's start answers its signals from this package's import on (see
web/start_signals.py)."""

from web.start_signals import signals_stop_the_start_of_a_server_process

signals_stop_the_start_of_a_server_process()
