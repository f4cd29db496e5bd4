// Package childproc gives the child processes tests start (the infergate
// binary re-executed, etcd, engines) the attributes that stop them from
// outliving the test binary: on Linux the kernel sends the child SIGKILL
// when the thread that started it exits (prctl PR_SET_PDEATHSIG, see
// prctl(2)), so a test binary killed by go test's -timeout, a panic or a
// SIGKILL, which runs no cleanup, leaves no child behind. Other systems
// have no such signal; there the tests' cleanups stop the children.
package childproc
