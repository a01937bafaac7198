package ledger_test

import (
	"context"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"pollgate/ledger"
)

// startRedisCluster starts three redis-server masters in cluster mode and
// joins them (redis-cli --cluster create). It returns their addresses.
func startRedisCluster(t *testing.T) []string {
	t.Helper()
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		skipOrFail(t, "redis-cli not found: install redis-server (it brings redis-tools)")
	}
	var addrs []string
	for range 3 {
		var addr string
		for {
			addr = freePort(t)
			_, p, _ := net.SplitHostPort(addr)
			port, _ := strconv.Atoi(p)
			// The cluster bus listens on port+10000.
			if port+10000 <= 65535 {
				if l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+10000)); err == nil {
					l.Close()
					break
				}
			}
		}
		srv := &redisServer{bin: redisServerBinary(t), dir: t.TempDir(), addr: addr,
			args: []string{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--appendonly", "yes"}}
		srv.start(t)
		t.Cleanup(srv.kill)
		addrs = append(addrs, addr)
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	ctx := context.Background()
	for _, a := range addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		for i := 0; ; i++ {
			info, _ := c.ClusterInfo(ctx).Result()
			if strings.Contains(info, "cluster_state:ok") {
				break
			}
			if i > 200 {
				c.Close()
				t.Fatalf("cluster node %s not ready: %s", a, info)
			}
			time.Sleep(50 * time.Millisecond)
		}
		c.Close()
	}
	return addrs
}

// The conformance suite on a real three-node Redis Cluster: every script
// must keep its keys in one slot (CROSSSLOT otherwise), pipelines and
// listing must work across nodes.
func TestRedisClusterConformance(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a three-node Redis Cluster; skipped with -short")
	}
	addrs := startRedisCluster(t)
	runConformance(t, func(t *testing.T, cfg storeConfig) ledger.Store {
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
		s := ledger.NewRedisStore(c, ledger.RedisOptions{Retention: cfg.Retention, AuditKey: cfg.AuditKey, Prefix: uniquePrefix()})
		t.Cleanup(func() { s.Close() })
		return s
	})
}

// OpenRedis takes a redis+cluster:// URL.
func TestOpenRedisClusterURL(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a three-node Redis Cluster; skipped with -short")
	}
	addrs := startRedisCluster(t)
	url := "redis+cluster://" + addrs[0] + "?addr=" + addrs[1] + "&addr=" + addrs[2]
	s, err := ledger.OpenRedis(context.Background(), url, ledger.RedisOptions{Prefix: uniquePrefix()})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	k := ledger.KeyOf(mustCreate(t, s, newOp("op_1", "job_1")))
	mustReserve(t, s, k, t0.Add(time.Second), ledger.Reserved)
	if _, err := ledger.OpenRedis(context.Background(), "redis+cluster://:pw@x?bogus=1", ledger.RedisOptions{}); err == nil ||
		!strings.Contains(err.Error(), "invalid Redis Cluster URL") || strings.Contains(err.Error(), "pw") {
		t.Fatalf("bad cluster URL: %v", err)
	}
}
