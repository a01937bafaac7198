package rules

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// maxRetryAfter bounds a Retry-After value; anything longer is treated as
// garbage rather than risking duration overflow.
const maxRetryAfter = 1_000_000_000 * time.Second

// ParseRetryAfter parses an HTTP Retry-After value (RFC 9110 10.2.3):
// delay-seconds or an HTTP-date in any of the three accepted forms
// (IMF-fixdate, obsolete RFC 850, asctime). A date in the past yields 0.
// Negative numbers, fractions, empty values and anything else are errors.
func ParseRetryAfter(value string, now time.Time) (time.Duration, error) {
	v := strings.TrimSpace(value)
	if v == "" {
		return 0, errors.New("empty Retry-After")
	}
	if isDigits(v) {
		if len(v) > 10 {
			return 0, fmt.Errorf("Retry-After %q is too large", clip(v, 32))
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n > int64(maxRetryAfter/time.Second) { // compare before multiplying: no overflow
			return 0, fmt.Errorf("Retry-After %q is too large", clip(v, 32))
		}
		return time.Duration(n) * time.Second, nil
	}
	if v[0] == '-' || v[0] == '+' {
		return 0, fmt.Errorf("Retry-After %q is not a non-negative number of seconds", clip(v, 32))
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, fmt.Errorf("Retry-After %q is neither delay-seconds nor an HTTP-date", clip(v, 32))
	}
	d := t.Sub(now)
	if d <= 0 {
		return 0, nil
	}
	if d > maxRetryAfter {
		return 0, fmt.Errorf("Retry-After %q is too far in the future", clip(v, 32))
	}
	return d, nil
}

// BackoffDelay is R5: raw = min(max, base * 2^attempt), computed without
// overflow, and the actual delay is uniform in [jitter_floor*raw, raw]. A
// JitterFloor outside (0,1] counts as the default 0.5. With a nil rnd the
// delay is raw. attempt < 0 counts as 0.
func BackoffDelay(b Backoff, attempt int, rnd Rand) time.Duration {
	raw := rawBackoff(b, attempt)
	if raw <= 0 || rnd == nil {
		return raw
	}
	floor := b.JitterFloor
	if !(floor > 0 && floor <= 1) {
		floor = 0.5
	}
	low := float64(raw) * floor
	f := rnd.Float64()
	if !(f >= 0 && f < 1) {
		f = 0
	}
	d := time.Duration(math.Ceil(low + f*(float64(raw)-low)))
	return min(max(d, time.Duration(math.Ceil(low))), raw)
}

func rawBackoff(b Backoff, attempt int) time.Duration {
	if b.Base <= 0 {
		return 0
	}
	maxD := b.Max
	if maxD < b.Base {
		maxD = b.Base
	}
	d := b.Base
	for i := 0; i < attempt; i++ {
		if d > maxD/2 {
			return maxD
		}
		d *= 2
	}
	return min(d, maxD)
}

// parseTimestamp reads an RFC 3339 string or a unix-seconds number.
func parseTimestamp(raw string, isNumber bool, num float64) (time.Time, error) {
	if isNumber {
		if math.IsNaN(num) || math.IsInf(num, 0) || num < 0 || num > 1e11 {
			return time.Time{}, fmt.Errorf("%v is not a unix timestamp", num)
		}
		sec, frac := math.Modf(num)
		return time.Unix(int64(sec), int64(frac*1e9)).UTC(), nil
	}
	t, err := time.Parse(time.RFC3339Nano, raw)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q is not an RFC 3339 timestamp", clip(raw, 40))
	}
	return t, nil
}

func isDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// clip shortens s to at most n bytes (plus "...") for messages and
// records, cutting at a rune boundary.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "..."
}

// Clock formats a time for story lines and messages (R25): 15:04:05 UTC.
func Clock(t time.Time) string { return t.UTC().Format("15:04:05") }

// CreatedStory is the first line of an operation's story (R25), e.g.
// "submitted job exp_71c, deadline 11:00:00, budget 12".
func CreatedStory(op *Operation) string {
	verb := "submitted job " + op.JobID
	if op.Origin == OriginFirstStatusCal {
		verb = "first status call for job " + op.JobID + " (not seen at submission)"
	}
	return fmt.Sprintf("%s, deadline %s, budget %d", verb, Clock(op.DeadlineAt), op.Budget.StatusRequests)
}

// ShortDuration prints 15m instead of 15m0s and 1h instead of 1h0m0s, as
// in escalation options and messages.
func ShortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}
