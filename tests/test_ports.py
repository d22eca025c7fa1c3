import socket

from berth.ports import free_ports


def test_free_ports_are_distinct_and_each_can_be_bound() -> None:
    # 200 draws: ports closed one by one before the next is chosen repeat within 200 draws
    # more often than not (a birthday bound over the kernel's ~14,000 choices).
    ports = free_ports(200)
    assert len(set(ports)) == 200
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
