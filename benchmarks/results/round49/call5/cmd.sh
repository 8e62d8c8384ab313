see ../call3/cmd.sh (call 5 of the same probe)
