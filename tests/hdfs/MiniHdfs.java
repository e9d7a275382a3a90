// A real HDFS for tests/test_ingest.py: Hadoop's MiniDFSCluster, one NameNode
// and one DataNode, on loopback. Run as a single-file program:
//   java -cp 'LIBS/*' MiniHdfs.java DATA_DIR NAMENODE_PORT
// It prints "ready hdfs://..." once the DataNode has registered, then serves
// until it is stopped.
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.hdfs.MiniDFSCluster;

public class MiniHdfs {
    public static void main(String[] args) throws Exception {
        Configuration conf = new Configuration();
        conf.set(MiniDFSCluster.HDFS_MINIDFS_BASEDIR, args[0]);
        MiniDFSCluster cluster = new MiniDFSCluster.Builder(conf)
                .nameNodePort(Integer.parseInt(args[1]))
                .numDataNodes(1)
                .build();
        cluster.waitActive();
        System.out.println("ready " + cluster.getURI());
        System.out.flush();
        Thread.sleep(Long.MAX_VALUE);
    }
}
