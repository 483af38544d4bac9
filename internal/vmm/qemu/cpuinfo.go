package qemu

import (
	"bufio"
	"bytes"
	"math"
	"strconv"
	"strings"
)

// cpuinfoTSCkHz reads the first "cpu MHz" of /proc/cpuinfo when the CPU has
// a constant TSC (then that figure is the TSC rate the kernel calibrated).
func cpuinfoTSCkHz(cpuinfo []byte) int {
	var mhz float64
	constant := false
	sc := bufio.NewScanner(bytes.NewReader(cpuinfo))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		key, val = strings.TrimSpace(key), strings.TrimSpace(val)
		switch key {
		case "cpu MHz":
			if mhz == 0 {
				mhz, _ = strconv.ParseFloat(val, 64)
			}
		case "flags":
			for _, f := range strings.Fields(val) {
				if f == "constant_tsc" {
					constant = true
				}
			}
		}
		if key == "" && mhz != 0 {
			break // end of the first CPU
		}
	}
	if !constant || mhz <= 0 {
		return 0
	}
	return int(math.Round(mhz * 1000))
}

// cpuHasVirt reports whether the first CPU lists vmx or svm.
func cpuHasVirt(cpuinfo []byte) bool {
	sc := bufio.NewScanner(bytes.NewReader(cpuinfo))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok || strings.TrimSpace(key) != "flags" {
			continue
		}
		for _, f := range strings.Fields(val) {
			if f == "vmx" || f == "svm" {
				return true
			}
		}
		return false
	}
	return false
}
