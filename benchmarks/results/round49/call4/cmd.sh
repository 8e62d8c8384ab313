see ../call3/cmd.sh (call 4 of the same probe)
