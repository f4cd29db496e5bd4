package childproc

import "syscall"

// Attr returns the SysProcAttr for a child that must die with the test
// binary: Pdeathsig SIGKILL. The signal comes when the OS thread that
// started the child exits; Go may end a thread that did a LockOSThread,
// so start children from goroutines that do not lock their thread.
func Attr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// Group is Attr for a child that also leads a new process group
// (Setpgid), so that the caller can kill it and its own children at once
// (kill(-pid)).
func Group() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
