#!/bin/sh
# mpirun's -launcher-exec in a launcher pod: ssh with the operator's key pair (mounted from the
# Secret NAME-ssh) to a worker pod. Worker pods get new host keys whenever a world restarts, so
# host keys are not pinned (as mpi-operator does).
exec ssh -i /etc/berth/ssh/id_ed25519 -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
    -o BatchMode=yes -o LogLevel=ERROR "$@"
