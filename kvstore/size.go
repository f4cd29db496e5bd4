package kvstore

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// ParseBytes reads a byte count: an integer with an optional unit, binary
// (KiB, MiB, GiB, TiB; K, M, G, T alike) or decimal (KB, MB, GB, TB), e.g.
// "4GiB", "512M", "1000000".
func ParseBytes(s string) (int64, error) {
	t := strings.TrimSpace(s)
	i := len(t)
	for i > 0 && (t[i-1] < '0' || t[i-1] > '9') {
		i--
	}
	num, unit := t[:i], strings.ToLower(strings.TrimSpace(t[i:]))
	mult := map[string]int64{"": 1, "b": 1,
		"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
		"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}[unit]
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || mult == 0 || n < 0 || n > math.MaxInt64/mult {
		return 0, fmt.Errorf("byte count %q: want an integer with an optional unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB)", s)
	}
	return n * mult, nil
}
