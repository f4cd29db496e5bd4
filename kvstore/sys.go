package kvstore

import "syscall"

// syscallEMFILE: out of file descriptors at accept (retried after a pause).
var syscallEMFILE = syscall.EMFILE
