package childproc

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestAttrKillsOrphan: a child started with Attr is killed when the
// process that started it dies without any cleanup. A helper process
// (this test binary, CHILDPROC_HELPER=1) starts "sleep 600" with Attr,
// prints its pid and is SIGKILLed; the sleep must be gone. Without Attr
// it is reparented and keeps running.
func TestAttrKillsOrphan(t *testing.T) {
	if os.Getenv("CHILDPROC_HELPER") == "1" {
		c := exec.Command("sleep", "600")
		c.SysProcAttr = Attr()
		if err := c.Start(); err != nil {
			os.Exit(2)
		}
		os.Stdout.WriteString(strconv.Itoa(c.Process.Pid) + "\n")
		select {} // until killed
	}
	if _, err := exec.LookPath("sleep"); err != nil {
		t.Skip("no sleep binary")
	}
	helper := exec.Command(os.Args[0], "-test.run=^TestAttrKillsOrphan$")
	helper.Env = append(os.Environ(), "CHILDPROC_HELPER=1")
	out, err := helper.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := helper.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 32)
	n, _ := out.Read(buf)
	pid, err := strconv.Atoi(strings.TrimSpace(string(buf[:n])))
	if err != nil {
		_ = helper.Process.Kill()
		t.Fatalf("helper said %q", buf[:n])
	}
	_ = helper.Process.Kill()
	_ = helper.Wait()
	// The kernel kills the sleep as the helper's thread exits; it is
	// then reaped by its new parent. Poll (no timing assertion: a minute
	// is a bound on a stuck kernel, not a measurement).
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		if err := syscall.Kill(pid, 0); err == syscall.ESRCH || zombie(pid) {
			return
		}
		if time.Now().After(deadline) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("child %d outlived its killed parent", pid)
		}
	}
}

// zombie reports whether pid has exited and awaits its reaping.
func zombie(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return true
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] == 'Z'
}
